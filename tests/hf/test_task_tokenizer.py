"""The task tokenizer as a tokenizer.json: every vocabulary entry and whole task prompts round-trip through the
text `TinyTokenizer.decode` writes, in `tokenizers` and in transformers (what sglang loads); the DeepSeek special
tokens sit on the parked ids and sglang's DeepSeek-V4 chat encoder accepts the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashmemory.hf.serving_model import SPECIAL_TOKENS
from flashmemory.hf.task_tokenizer import build_tokenizer, filler, parked_ids, write_tokenizer
from flashmemory.tasks import generate, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def hf(tok):
    return build_tokenizer(tok, 1024)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tok) -> Path:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, 1024, tok)
    return d


def test_every_vocabulary_entry_round_trips(tok, hf) -> None:
    bad = [(i, w, hf.encode(tok.decode([i])).ids) for i, w in enumerate(tok.words)]
    assert [b for b in bad if b[2] != [b[0]]] == []


@pytest.mark.parametrize("task", ["mqar", "niah_single", "niah_multikey", "mrcr"])
def test_task_prompts_round_trip_through_their_text(tok, hf, task: str) -> None:
    it = generate(task, 600, n=1, seed=8, tokenizer=tok)[0]
    ids = tok.encode_chat(it.messages)
    text = tok.decode(ids)
    assert "\n" in text and text.startswith("<bos> <|user|>")
    assert hf.encode(text).ids == ids


def test_specials_are_parked_after_the_vocabulary_and_every_id_has_a_token(tok, hf) -> None:
    assert list(parked_ids(tok)) == list(range(811, 837))  # the shipped vocabulary has 811 entries
    assert [hf.token_to_id(s) for s in SPECIAL_TOKENS] == list(parked_ids(tok))
    assert hf.get_vocab_size() == 1024 and hf.id_to_token(1023) == filler(1023)
    assert hf.encode("The APPLE <|end|>").ids == [tok.ids["the"], tok.ids["apple"], tok.ids["<|end|>"]]
    with pytest.raises(ValueError, match="exceed 830"):
        build_tokenizer(tok, 830)


def test_transformers_loads_it_with_the_same_ids(tok, hf_dir: Path) -> None:
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    it = generate("niah_single", 600, n=1, seed=9, tokenizer=tok)[0]
    ids = tok.encode_chat(it.messages)
    assert t.encode(tok.decode(ids)) == ids  # add_special_tokens=True adds nothing
    assert t.convert_ids_to_tokens(811) == SPECIAL_TOKENS[0]


def test_sglangs_deepseek_v4_chat_encoder_accepts_it(hf_dir: Path) -> None:
    """What the server runs at start-up (serving_deepseek_recipe.py:74): without the specials it raises."""
    from sglang.srt.parser.deepseek_recipe_renderer import DeepSeekRecipe
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    recipe = DeepSeekRecipe.from_hf_tokenizer("dsv4", t)
    ids = recipe.encode({"messages": [{"role": "user", "content": ""}], "thinking": True})
    user, assistant = (811 + SPECIAL_TOKENS.index(s) for s in ("<｜User｜>", "<｜Assistant｜>"))
    assert ids[0] == 811 and user in ids and assistant in ids
