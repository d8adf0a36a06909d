"""The checks behind `scripts/gpu_core_check.py` (the package's own device code on one GPU, without sglang):
`core` (imports, sizes, helpers), `offload_check` (a), `level2_check` (b), `perf_check` (c, d)."""
