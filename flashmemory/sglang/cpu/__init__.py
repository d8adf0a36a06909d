"""CPU execution layer for sglang 0.5.23's DeepSeek-V4 path (gate: SGLANG_FLASHMEMORY_CPU=1, with --device cpu).

Split by job (`README.md` maps each op to its sglang file:line and its test):
- `ops/`: pure-torch CPU versions of the CUDA-only ops on the DSv4 prefill and decode path (`norm_rope`,
  `indexer_q`, `compress_plan`, `compressor`, `stores`, `mhc`, `activation`, `sparse_attention`, `hisparse`).
  Nothing there imports sglang.
- the patch tables (rows of `flashmemory.sglang.plumbing.patch_spec.Patch`, applied by
  `flashmemory.sglang.plumbing.patching`):
  `platform` (sglang's env switches and the CUDA-only wheels stubbed by `stubs`; also the `sglang.srt.platforms`
  entry point, activated in every sglang process before anything imports those wheels), `patches_kernels`,
  `patches_runtime`, `patches_hisparse` (its host pool hooks in `hisparse_pool`, its swap-in counters and trace in
  `hisparse_record`), `pd`.
- `install`: the `flashmemory_cpu` plugin entry point (the code rows of feature "cpu"); `cpu_platform`: the
  platform class. Importing this package does not import sglang.
"""
