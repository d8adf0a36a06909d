"""CPU execution layer for sglang 0.5.23's DeepSeek-V4 path (gate: SGLANG_FLASHMEMORY_CPU=1, with --device cpu).

- `platform`: the `sglang.srt.platforms` entry point; activated in every sglang process when the platform is
  first resolved (import of `sglang.srt.utils.common`), it sets sglang's own env switches and stubs the
  CUDA-only kernel wheels before anything imports them.
- `install`: called from the plugin's `register()` (entry point `sglang.srt.plugins`), registers the torch
  fallbacks (`patches_*`) through sglang's HookRegistry and checks each one really applied.
- The pure-torch ops the fallbacks call live beside them (one module per op family).
"""
