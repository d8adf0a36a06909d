"""Dump inputs: upstream JSONL / JSON-list items, and the byte-level chat tokenizer of the hf backend.

JSONL (upstream MRCR / "formated"): one object per line with `prompt` = a JSON string that decodes to
an OpenAI messages list (a list itself, or a plain string, is accepted too) and optional `answer`.
JSON: a list of objects with a plain-string `prompt`, wrapped as one user message with upstream's
"\\boxed{}" instruction. Bad items are reported by line (or list position) and skipped. Input must be
UTF-8: a JSONL line with an invalid byte is such a bad item (never dumped with U+FFFD in its place); a
.json list with one is refused whole, naming the line.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BOXED = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
ROLES = ("system", "user", "assistant")

Tokenize = Callable[[list[dict]], list[int]]


class InputError(ValueError):
    """The input file cannot be used at all (missing, wrong type)."""


@dataclass(frozen=True)
class InputItem:
    item_index: int  # 0-based position among the file's items (non-blank lines for JSONL)
    messages: list[dict]  # [{"role": ..., "content": str}]
    answer: str | None
    where: str  # "file.jsonl:12" for messages

    def content_sha256(self) -> str:
        """sha256 (64 hex) of the item's messages and answer as canonical JSON: what a resumed dump compares
        (with the file name and item index) to tell an item it already dumped from a changed one."""
        blob = json.dumps(
            {"messages": self.messages, "answer": self.answer},
            sort_keys=True,
            ensure_ascii=False,
            separators=(",", ":"),
        )
        return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()


def _check_text(text: str, what: str) -> None:
    """ValueError when `text` is not encodable as UTF-8 (a lone surrogate from a \\ud800-style JSON escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what} holds a lone surrogate (U+{ord(text[e.start]):04X}, a JSON \\u escape of half a "
            f"pair) at character {e.start}: not valid UTF-8 text"
        ) from None


def _messages(prompt: object) -> list[dict]:
    if isinstance(prompt, str):
        try:
            decoded = json.loads(prompt)
        except json.JSONDecodeError:
            decoded = prompt
        prompt = decoded if isinstance(decoded, list) else [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("`prompt` must be a non-empty messages list (or a JSON string of one)")
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} must be {{'role': one of {ROLES}, 'content': str}}, got {str(m)[:80]}")
        _check_text(m["content"], f"message {i} content")
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def load_items(path: str | Path) -> tuple[list[InputItem], list[str]]:
    """Parse the input file. Returns (good items, error messages naming line/position).

    InputError (one line naming the file) when it is missing, not a file, unreadable or of an unknown type."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{p}: --input is a directory, not a file")
    if not p.is_file():
        raise InputError(f"{p}: no such input file")
    try:
        return _parse(p)
    except OSError as e:
        raise InputError(f"{p}: cannot read the input file ({e.strerror or e})") from None


def _parse(p: Path) -> tuple[list[InputItem], list[str]]:
    items, errors = [], []
    if p.suffix == ".json":
        raw = p.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw.count(b"\n", 0, e.start) + 1
            col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
            raise InputError(
                f"{p}:{line}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {col} of the line); "
                "fix or re-encode the file"
            ) from None
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise InputError(
                f"{p}: not valid JSON (line {getattr(e, 'lineno', '?')}: {getattr(e, 'msg', e)})"
            ) from None
        if not isinstance(data, list):
            raise InputError(f"{p}: expected a JSON list of items, got {type(data).__name__}")
        for i, obj in enumerate(data):
            where = f"{p.name}[{i}]"
            try:
                if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                    raise ValueError("expected an object with a string `prompt`")
                _check_text(obj["prompt"], "prompt")
                items.append(
                    InputItem(i, [{"role": "user", "content": obj["prompt"] + BOXED}], obj.get("answer"), where)
                )
            except ValueError as e:
                errors.append(f"{where}: {e}")
        return items, errors
    if p.suffix != ".jsonl":
        raise InputError(f"{p}: unknown input type {p.suffix!r} (use .jsonl or a .json list)")
    idx = 0
    with open(p, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{p.name}:{lineno}"
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(
                        f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line); "
                        "item skipped, never dumped with a replacement character"
                    ) from None
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
                except RecursionError:
                    raise ValueError("not valid JSON (nested too deeply)") from None
                if not isinstance(obj, dict) or "prompt" not in obj:
                    raise ValueError("expected an object with a `prompt` field")
                answer = obj.get("answer")
                items.append(
                    InputItem(idx, _messages(obj["prompt"]), answer if isinstance(answer, str) else None, where)
                )
            except ValueError as e:
                errors.append(f"{where}: {e}")
            idx += 1
    return items, errors


class ByteChatTokenizer:
    """Deterministic byte-level chat tokenizer: ids 0..7 are specials, byte b is id 8 + b (needs vocab >= 264).

    Rendering: <bos> then per message <|role|> content-bytes "\\n", then <|assistant|> (the generation
    prompt), plus "<think>\\n" when thinking. Every id is < vocab_size by construction.
    """

    BOS, EOS, SYSTEM, USER, ASSISTANT = 0, 1, 2, 3, 4
    OFFSET = 8

    def __init__(self, vocab_size: int, thinking: bool = False):
        if vocab_size < self.OFFSET + 256:
            raise InputError(f"the byte tokenizer needs vocab_size >= {self.OFFSET + 256}, model has {vocab_size}")
        self.vocab_size = vocab_size
        self.thinking = thinking
        self._role = {"system": self.SYSTEM, "user": self.USER, "assistant": self.ASSISTANT}

    def encode_text(self, text: str) -> list[int]:
        return [self.OFFSET + b for b in text.encode("utf-8")]

    def __call__(self, messages: list[dict]) -> list[int]:
        ids = [self.BOS]
        for m in messages:
            ids.append(self._role[m["role"]])
            ids.extend(self.encode_text(m["content"] + "\n"))
        ids.append(self.ASSISTANT)
        if self.thinking:
            ids.extend(self.encode_text("<think>\n"))
        return ids

    def decode(self, ids: list[int]) -> str:
        """Byte ids back to text; special and out-of-range ids are dropped."""
        return bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < self.OFFSET + 256).decode("utf-8", "replace")
