"""Tests of `flashmemory.sglang.dump`."""
