"""The HiSparse prefetch mode: hints prefetched into sglang's HiSparse hot buffer (`prefetch`: the mode's hooks
and patch table), its process state and counters (`state`), and Level 1 as the hint source (`hint`).

May import: `plumbing` (its own patch table), `decode` (the process state, the pool geometry, the core's
configs), `metrics`, `cpu` (the swap-in op it calls on a hint). Nothing imports it but the patch registry (by
string).
"""
