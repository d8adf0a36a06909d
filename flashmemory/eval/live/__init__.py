"""`flashmemory eval live`: the task suite served through real sglang (P + D + router on this machine), arm by arm,
scored with the task scorer and set beside the replay frontier's numbers for the same documents.

- `arms`: what each arm starts (stock, FlashMemory at a page budget, HiSparse and HiSparse+prefetch at the
  matching hot buffer) and its settings.
- `run`: the plan, per-document records (resumable, fingerprinted by content), the loop over arms and documents.
- `stack`: one arm's stack under the shared live lock, the OpenAI-client request, D's /metrics.
- `replay`: the replay frontier's rows and the replay's own greedy tokens for the same documents.
- `report`: live.json / live.md.
- `cli`: the command's flags.
"""
