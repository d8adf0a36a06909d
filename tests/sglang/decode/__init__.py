"""Tests of `flashmemory.sglang.decode`."""
