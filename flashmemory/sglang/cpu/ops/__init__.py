"""Pure-torch versions of sglang's CUDA/JIT ops on the DeepSeek-V4 path, one module per sglang feature.

Nothing here imports sglang, at module level or inside a function (tests/sglang/test_import_graph.py checks it):
whatever an op needs from sglang is passed in by its caller; the drop-ins that must return sglang's own types
live with the patch tables in `flashmemory/sglang/cpu/`.
"""
