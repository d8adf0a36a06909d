"""A tiny DeepSeek-V4 trained to retrieve: band attention, curriculum data, indexer KL, trainer and probe."""
