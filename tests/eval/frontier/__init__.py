"""Tests of `flashmemory.eval.frontier`."""
