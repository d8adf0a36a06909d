"""The plugin's plumbing: how FlashMemory's changes reach sglang. The one patch form (`patch_spec.Patch`), the
table of FlashMemory's own hooks (`targets`), the one apply-and-verify loop with the registry of every table
(`patching`), the gate table (`gates`) and `flashmemory patches` (`patches_cli`).

May import: `decode` (the process state records which rows were applied; `StartupError` is the decode side's
start-up refusal). Never `hisparse`, `cpu` or `plugin`: their tables are named by string in `patching.TABLES`.
"""
