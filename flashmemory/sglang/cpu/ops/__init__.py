"""Torch versions of sglang CUDA/JIT ops, one module per sglang feature (no sglang import at module level)."""
