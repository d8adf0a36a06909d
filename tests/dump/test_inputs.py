import json

import pytest

from flashmemory.dump.inputs import BOXED, ByteChatTokenizer, InputError, load_items


def test_jsonl_bad_lines_reported_with_line_numbers(tmp_path):
    good = {"prompt": json.dumps([{"role": "user", "content": "hi"}]), "answer": "a"}
    lines = [
        json.dumps(good),
        "{not json",
        "",
        json.dumps({"answer": "no prompt"}),
        json.dumps({"prompt": json.dumps([{"role": "bot", "content": "x"}])}),
        json.dumps({"prompt": "plain text prompt"}),
    ]
    p = tmp_path / "in.jsonl"
    p.write_text("\n".join(lines) + "\n")
    items, errors = load_items(p)
    assert [e.split(":")[1] for e in errors] == ["2", "4", "5"]
    assert "in.jsonl:2: not valid JSON" in errors[0] and "prompt" in errors[1] and "message 0" in errors[2]
    assert [it.item_index for it in items] == [0, 4]  # blank line 3 is not an item
    assert items[0].messages == [{"role": "user", "content": "hi"}] and items[0].answer == "a"
    assert items[1].messages == [{"role": "user", "content": "plain text prompt"}] and items[1].where == "in.jsonl:6"


def test_json_list(tmp_path):
    p = tmp_path / "in.json"
    p.write_text(json.dumps([{"prompt": "2+2?"}, {"x": 1}]))
    items, errors = load_items(p)
    assert items[0].messages == [{"role": "user", "content": "2+2?" + BOXED}]
    assert errors == ["in.json[1]: expected an object with a string `prompt`"]
    p.write_text("{}")
    with pytest.raises(InputError, match="JSON list"):
        load_items(p)
    with pytest.raises(InputError, match="no such input"):
        load_items(tmp_path / "missing.jsonl")


def test_byte_tokenizer():
    tok = ByteChatTokenizer(1024)
    msgs = [{"role": "system", "content": "é"}, {"role": "user", "content": "ab"}]
    ids = tok(msgs)
    assert ids == [0, 2, 8 + 0xC3, 8 + 0xA9, 8 + 10, 3, 8 + 97, 8 + 98, 8 + 10, 4]
    assert ids == tok(msgs) and max(ids) < 1024
    assert tok.decode(ids) == "é\nab\n"
    assert ByteChatTokenizer(1024, thinking=True)(msgs)[-8:] == tok.encode_text("<think>\n")
    with pytest.raises(InputError, match="vocab_size >= 264"):
        ByteChatTokenizer(200)
