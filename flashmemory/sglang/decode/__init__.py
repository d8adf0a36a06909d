"""FlashMemory's decode serving inside sglang: the hooks sglang calls (`hooks`, `queue_gate`), the per-process
state they call into (`runtime.RUNTIME`, with one forward's scratch in `context`), the Path-P adapters that put
the offload core behind sglang's c4 pool (`offload_adapter` the base, `copy_adapter`, `shrink_adapter`, built by
`adapter_factory`), what they use (`geometry`, `core_config`, `loc_map`, `page_reads`, `resident_topk`,
`sideband`, `retriever_load`, `memory_budget`), the per-request failure guard (`guard`) and the start-up
refusals (`refusals`).

May import: `metrics`, `dump`. Never `plumbing` (the hooks do not know how they are patched in), `hisparse`,
`cpu` or `plugin`.
"""
