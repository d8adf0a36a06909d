"""The CPU end-to-end demo (`flashmemory demo`, `make demo`); see `flashmemory.demo.pipeline`."""
