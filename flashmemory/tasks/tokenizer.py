"""Tokenizers for the task suite: a tiny word-level one shipped with the package, or a local HF directory.

Tiny tokenizer: `vocab.txt` (one entry per line, id = line number, < 1000 entries so ids fit the tiny
models' vocab of 1024). Text is lowercased and split into words `[a-z]+`, single digits (so any number
tokenizes), newlines (`<nl>`) and single punctuation characters; anything not in the vocabulary is `<unk>`.
Decoding joins pieces with one space, except: no space before `.,:;?!)`, after `(`, between two digits,
or around a newline. Text in that canonical form (lowercase, in-vocab) round-trips exactly.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Protocol

from flashmemory.errors import UserError

VOCAB_PATH = Path(__file__).with_name("vocab.txt")
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
_PIECE = re.compile(r"\n|[a-z]+|\d|[^\sa-z\d]")
_ATTACH_LEFT = set(".,:;?!)")


class TokenizerError(UserError):
    """A tokenizer could not be loaded or used."""


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]: ...


class TinyTokenizer:
    """Word-level tokenizer over `vocab.txt`. Ids are line numbers; `<unk>` for unknown words."""

    def __init__(self, vocab_path: str | os.PathLike = VOCAB_PATH, max_vocab: int = 1024):
        path = Path(vocab_path)
        try:
            words = path.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise TokenizerError(f"cannot read vocabulary {path}: {e}") from None
        seen: dict[str, int] = {}
        for i, w in enumerate(words):
            if not w or w != w.strip():
                raise TokenizerError(f"{path} line {i + 1}: empty entry or surrounding whitespace")
            if w in seen:
                raise TokenizerError(f"{path} line {i + 1}: {w!r} duplicates line {seen[w] + 1}")
            seen[w] = i
        for need in ("<unk>", "<bos>", "<nl>", "<|end|>", *ROLE_TOKENS.values(), *"0123456789"):
            if need not in seen:
                raise TokenizerError(f"{path}: required entry {need!r} is missing")
        if len(words) > max_vocab:
            raise TokenizerError(f"{path}: {len(words)} entries exceed the model vocabulary {max_vocab}")
        self.name = "tiny"
        self.vocab_size = len(words)
        self.words = words
        self.ids = seen
        self.unk = seen["<unk>"]

    def pieces(self, text: str) -> list[str]:
        """Lowercased surface pieces; `<nl>` stands for a newline."""
        return ["<nl>" if p == "\n" else p for p in _PIECE.findall(text.lower())]

    def encode(self, text: str) -> list[int]:
        return [self.ids.get(p, self.unk) for p in self.pieces(text)]

    def decode(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        prev = ""
        for i in ids:
            if not 0 <= int(i) < self.vocab_size:
                raise TokenizerError(f"token id {i} outside the vocabulary [0, {self.vocab_size})")
            w = self.words[int(i)]
            if w == "<nl>":
                out.append("\n")
            elif not out or prev in ("<nl>", "(") or w in _ATTACH_LEFT or (w.isdigit() and prev.isdigit()):
                out.append(w)
            else:
                out.append(" " + w)
            prev = w
        return "".join(out)

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """`<bos> (<|role|> content <|end|>)* <|assistant|>` — the generation prompt is always added."""
        ids = [self.ids["<bos>"]]
        for i, m in enumerate(messages):
            role = m.get("role")
            if role not in ROLE_TOKENS:
                raise TokenizerError(f"message {i}: role {role!r} is not one of {sorted(ROLE_TOKENS)}")
            ids += [self.ids[ROLE_TOKENS[role]], *self.encode(str(m.get("content", ""))), self.ids["<|end|>"]]
        return ids + [self.ids["<|assistant|>"]]


class HFTokenizer:
    """A local transformers tokenizer directory (no network). Uses the chat template when it has one."""

    def __init__(self, path: str | os.PathLike):
        p = Path(path)
        if not p.is_dir():
            raise TokenizerError(f"tokenizer directory {p} does not exist (or is not a directory)")
        try:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except Exception as e:  # transformers raises many types for a bad directory
            raise TokenizerError(f"cannot load a tokenizer from {p}: {type(e).__name__}: {e}") from None
        self.name = str(p)
        self.vocab_size = len(self.tok)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        msgs = [dict(m) for m in messages]
        if getattr(self.tok, "chat_template", None):
            out = self.tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
            if isinstance(out, Mapping) or hasattr(out, "keys"):  # transformers 5 may return a BatchEncoding
                out = out["input_ids"]
            return list(out)
        return self.encode("\n\n".join(f"{m['role']}: {m['content']}" for m in msgs))


@lru_cache(maxsize=4)
def _tiny(path: str) -> TinyTokenizer:
    return TinyTokenizer(path)


def load_tokenizer(spec: str | None = None) -> Tokenizer:
    """`None` or "tiny": the shipped word-level tokenizer; otherwise a local HF tokenizer directory."""
    if spec is None or spec == "tiny":
        return _tiny(str(VOCAB_PATH))
    return HFTokenizer(spec)
