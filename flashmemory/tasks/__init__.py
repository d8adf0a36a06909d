"""Long-context task suite (RULER-style NIAH / vt / cwe / fwe and an MRCR-like chat) with its tokenizers."""

from flashmemory.tasks.suite import TASKS, TaskItem, generate, read_jsonl, score, write_jsonl
from flashmemory.tasks.tokenizer import HFTokenizer, TinyTokenizer, TokenizerError, load_tokenizer

__all__ = [
    "TASKS",
    "TaskItem",
    "generate",
    "read_jsonl",
    "score",
    "write_jsonl",
    "HFTokenizer",
    "TinyTokenizer",
    "TokenizerError",
    "load_tokenizer",
]
