"""Retriever training: data configs, causal samples, losses, native init, the loop, DDP and verify."""
