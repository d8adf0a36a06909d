"""Tiny tokenizer: vocabulary limits, round trip, digits, <unk>, chat ids; the HF directory path offline."""

from __future__ import annotations

import pytest

from flashmemory.tasks import generate, load_tokenizer
from flashmemory.tasks.tokenizer import VOCAB_PATH, HFTokenizer, TinyTokenizer, TokenizerError


@pytest.fixture(scope="module")
def tok() -> TinyTokenizer:
    return load_tokenizer()


def test_vocab_fits_the_tiny_models(tok):
    assert tok.vocab_size < 1000
    assert len(set(tok.words)) == tok.vocab_size
    for d in "0123456789":
        assert d in tok.ids


def test_round_trip_on_in_vocab_text(tok):
    text = (
        "the special magic number for red fence is: 7512870.\nvariable apple = 48213, and the owl slept "
        "near the (golden) river?"
    )
    ids = tok.encode(text)
    assert tok.unk not in ids
    assert tok.decode(ids) == text
    assert all(0 <= i < 1024 for i in ids)


def test_numbers_split_into_digits_and_unknown_words_map_to_unk(tok):
    assert tok.encode("4096") == [tok.ids[c] for c in "4096"]
    ids = tok.encode("the zyzzyva sang")
    assert ids == [tok.ids["the"], tok.unk, tok.ids["sang"]]
    assert tok.decode(ids) == "the <unk> sang"
    assert tok.encode("The APPLE") == tok.encode("the apple")


def test_generated_prompts_are_in_vocab_and_round_trip(tok):
    for task in ("niah_multikey", "vt", "cwe", "fwe", "mrcr"):
        item = generate(task, 1024, n=1, seed=3)[0]
        for m in item.messages:
            ids = tok.encode(m["content"])
            assert tok.unk not in ids, (task, [p for p in tok.pieces(m["content"]) if p not in tok.ids])
            assert tok.decode(ids) == m["content"]
        assert max(tok.encode_chat(item.messages)) < 1024


def test_chat_encoding_marks_roles(tok):
    ids = tok.encode_chat([{"role": "system", "content": "be kind"}, {"role": "user", "content": "hi"}])
    assert ids[0] == tok.ids["<bos>"] and ids[-1] == tok.ids["<|assistant|>"]
    assert ids.count(tok.ids["<|end|>"]) == 2 and tok.ids["<|system|>"] in ids
    with pytest.raises(TokenizerError, match="role 'robot'"):
        tok.encode_chat([{"role": "robot", "content": "x"}])
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_bad_vocab_files_are_named(tmp_path):
    p = tmp_path / "v.txt"
    p.write_text("a\nb\na\n")
    with pytest.raises(TokenizerError, match="line 3"):
        TinyTokenizer(p)
    p.write_text(VOCAB_PATH.read_text() + "".join(f"w{i}\n" for i in range(400)))
    with pytest.raises(TokenizerError, match="exceed"):
        TinyTokenizer(p)
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing"))


def test_hf_directory_offline(tmp_path, tok):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    words = tok.words
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    t = tokenizers.Tokenizer(model)
    t.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>")
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    fast.save_pretrained(tmp_path)
    hf = load_tokenizer(str(tmp_path))
    assert isinstance(hf, HFTokenizer)
    item = generate("niah_single", 600, n=1, seed=1, depth=0.3, tokenizer=hf)[0]
    assert item.n_tokens <= 600 and item.n_tokens == len(hf.encode_chat(item.messages))
    assert item.n_tokens > 500
    assert abs(item.needle_depth - 0.3) < 0.05
