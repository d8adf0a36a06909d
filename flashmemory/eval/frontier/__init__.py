"""The selection frontier (`flashmemory eval frontier`): tokens kept against resident pages for each selection
method, over documents of the eval set.

`run` drives the sweep (one capture forward, then every method and budget per step), `decode` the
one-forward-per-method decode, `cost` each method's counted costs, `identity` a run's settings fingerprint and
its records' checks, `compare` two runs side by side, `report` / `markdown` / `hisparse` the aggregate and its
tables, `cli` the command.
"""
