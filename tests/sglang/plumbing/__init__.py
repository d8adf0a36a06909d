"""Tests of `flashmemory.sglang.plumbing`."""
