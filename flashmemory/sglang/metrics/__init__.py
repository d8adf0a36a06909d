"""What the serving plugin reports: the Prometheus metrics on sglang's /metrics (`prometheus`), the export
thread and the diagnostics file (`exporter`), and the miss monitor's scorer and counters (`miss_monitor`).

May import: nothing else under `flashmemory/sglang/` (the adapter is handed in, never imported).
"""
