"""CPU execution layer for sglang 0.5.23's DeepSeek-V4 path (gate: SGLANG_FLASHMEMORY_CPU=1, with --device cpu).

Pure-torch CPU versions of the CUDA-only ops on the DSv4 prefill and decode path: each public function of the
op modules (`norm_rope`, `indexer_q`, `compress_plan`, `compressor`, `stores`, `mhc`, `activation`)
is a drop-in for the sglang function named in its docstring (same arguments, same output layout and bytes);
`README.md` maps each to its sglang file:line and its test. Importing this package does not import sglang.

The layer that installs them:
- `platform`: the `sglang.srt.platforms` entry point; activated in every sglang process when the platform is
  first resolved (import of `sglang.srt.utils.common`), it sets sglang's own env switches and stubs the
  CUDA-only kernel wheels (`stubs`) before anything imports them; `cpu_platform` is the platform class.
- `install`: called from the plugin's `register()` (entry point `sglang.srt.plugins`), registers the patch
  tables (`patches_kernels`, `patches_runtime`) through sglang's HookRegistry and checks each one applied.
"""
