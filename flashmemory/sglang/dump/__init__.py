"""Dump mode (data generation): a request that carries a `flashmemory_dump` block has its decode steps recorded
and written as golden-label files (`mode.DumpRecorder`).

May import: nothing else under `flashmemory/sglang/` (it speaks `flashmemory.dump`'s protocol and format).
"""
