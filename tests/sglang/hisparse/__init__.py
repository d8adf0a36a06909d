"""Tests of `flashmemory.sglang.hisparse`."""
