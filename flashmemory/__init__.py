"""FlashMemory: lookahead Memory-Indexer recall and CSA KV offload for DeepSeek-V4.

One concept per subpackage: `retriever` (Memory Indexer, fp8 keys), `labels` (golden labels),
`residency` (Level-1 selection, Level-2 mask), `offload` (mirror, reserve, recall), `hf` (CPU
reference engine), `sglang` (plugin), `train`, `eval`, `bench`, `tasks`, `cli`.
"""

__version__ = "0.1.0"
