"""The task suite's word-level tokenizer as a `tokenizer.json` a server loads (sglang, transformers).

Ids 0..len(vocab.txt)-1 are the task tokenizer's own (`flashmemory.tasks.tokenizer.TinyTokenizer`), with the same
splitting: lowercase, then pieces `\\n | [a-z]+ | one digit | one other non-space character`, spaces dropped; a
newline is the `<nl>` id, an unknown piece `<unk>`; the bracketed entries (`<bos>`, `<|user|>`, `<|end|>`, ...) are
added tokens, matched whole in the text. So the text `TinyTokenizer.decode` writes encodes back to the same ids
(`tests/hf/test_task_tokenizer.py` checks every entry and whole task prompts).

sglang 0.5.23 refuses to start a DeepSeek-V4 model whose tokenizer lacks the DeepSeek special tokens: its chat
renderer (`srt/parser/deepseek_recipe_renderer.py`, set up at boot by `serving_deepseek_recipe.py:74`) encodes a
probe conversation at start-up and needs `<｜begin▁of▁sentence｜>`, `<think>`, `<｜User｜>` and `<｜Assistant｜>`
as added tokens; system prompts, tasks and images use the others. All 26 (`serving_model.SPECIAL_TOKENS`) are
parked on the ids right after the task vocabulary (811..836 for the shipped one), which the trained model never
saw; ids above them up to `vocab_size` get filler entries so every id the model can emit has a token.
"""

from __future__ import annotations

import json
from pathlib import Path

from flashmemory.hf.serving_model import SPECIAL_TOKENS
from flashmemory.tasks.tokenizer import TinyTokenizer

PIECES = r"\n|[a-z]+|\d|[^\sa-z\d]"  # TinyTokenizer's `_PIECE`
NEWLINE = "<nl>"


def parked_ids(tok: TinyTokenizer) -> range:
    """The ids the DeepSeek special tokens take: right after the task vocabulary."""
    return range(tok.vocab_size, tok.vocab_size + len(SPECIAL_TOKENS))


def filler(i: int) -> str:
    return f"<｜unused_{i}｜>"


def build_tokenizer(tok: TinyTokenizer, vocab_size: int):
    """A `tokenizers.Tokenizer` over `tok`'s vocabulary (same ids), the DeepSeek specials at `parked_ids(tok)` and
    fillers up to `vocab_size`. Raises ValueError when they do not fit."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    n = tok.vocab_size + len(SPECIAL_TOKENS)
    if n > vocab_size:
        raise ValueError(
            f"task vocabulary {tok.vocab_size} + {len(SPECIAL_TOKENS)} DeepSeek tokens exceed {vocab_size}"
        )
    vocab = {("\n" if w == NEWLINE else w): i for i, w in enumerate(tok.words)}
    for j, s in enumerate(SPECIAL_TOKENS):
        vocab[s] = tok.vocab_size + j
    for i in range(n, vocab_size):
        vocab[filler(i)] = i
    out = Tokenizer(models.WordLevel(vocab=vocab, unk_token=tok.words[tok.unk]))
    out.normalizer = normalizers.Lowercase()
    out.pre_tokenizer = pre_tokenizers.Split(Regex(PIECES), behavior="removed", invert=True)
    out.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins pieces with spaces; no ## pieces exist
    bracketed = [w for w in tok.words if len(w) > 1 and w.startswith("<") and w.endswith(">") and w != NEWLINE]
    out.add_tokens([AddedToken(w, special=False, normalized=False) for w in bracketed])
    out.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    return out


def write_tokenizer(out_dir: str | Path, vocab_size: int, tok: TinyTokenizer | None = None) -> list[str]:
    """Write tokenizer.json and tokenizer_config.json for the task vocabulary into `out_dir` (an existing directory
    the caller owns, e.g. a checkpoint's temp dir); returns the file names written."""
    from flashmemory.tasks.tokenizer import load_tokenizer

    tok = tok or load_tokenizer(None)
    out = Path(out_dir)
    build_tokenizer(tok, vocab_size).save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 65536,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return ["tokenizer.json", "tokenizer_config.json"]
