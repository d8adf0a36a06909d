"""Tests of `flashmemory.sglang.metrics`."""
