import json
import pickle

import pytest
import torch

from flashmemory.dump import DumpFormatError, list_docs, load_doc, read_metadata
from flashmemory.dump.writer import DumpWriter, save_doc_file

from .synth import make_doc


def test_round_trip(tmp_path):
    doc = make_doc(3)
    path = save_doc_file(tmp_path / "doc_00003.safetensors", doc)
    back = load_doc(path)
    assert back.doc_index == 3 and back.rid == "r3" and back.n_prompt_blocks == 9 and back.ratio == 4
    assert back.target_layers == [1, 3] and back.n_tokens == 9
    for L in (1, 3):
        assert back.hidden[L].dtype == torch.float32
        torch.testing.assert_close(back.hidden[L], doc.hidden[L].bfloat16().float())
        assert torch.equal(back.positions[L], doc.positions[L]) and torch.equal(back.compk[L], doc.compk[L])
    assert back.labels.to_rows() == doc.labels.to_rows()
    assert back.n_chunks_at.tolist() == [(p + 1) // 4 for p in range(37, 46)]
    assert set(back.native_logits) == {(L, t) for L in (1, 3) for t in range(3)}
    assert torch.equal(back.native_logits[(1, 2)], doc.native_logits[(1, 2)])
    assert torch.equal(back.input_ids, doc.input_ids)


def test_truncated_and_malformed(tmp_path):
    path = save_doc_file(tmp_path / "doc_00000.safetensors", make_doc())
    data = path.read_bytes()
    cut = tmp_path / "doc_00001.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(DumpFormatError, match="doc_00001.safetensors.*truncated"):
        load_doc(cut)
    with pytest.raises(DumpFormatError, match="no such file"):
        load_doc(tmp_path / "doc_00009.safetensors")


def test_mismatched_shapes_named(tmp_path):
    doc = make_doc()
    doc.hidden[3] = doc.hidden[3][:-1]
    with pytest.raises(DumpFormatError, match="hidden_layer_3"):
        save_doc_file(tmp_path / "doc_00000.safetensors", doc)
    doc = make_doc()
    doc.compk[1] = doc.compk[1][:3]
    with pytest.raises(DumpFormatError, match="compk"):
        doc.validate()
    doc = make_doc()
    doc.label_pointers = doc.label_pointers[:-1]
    with pytest.raises(DumpFormatError, match="pointers"):
        doc.validate()


def test_pickle_refused_unless_allowed(tmp_path):
    doc = make_doc(0)
    from flashmemory.dump.writer import doc_tensors

    tensors, _ = doc_tensors(doc)
    p = tmp_path / "doc_00000.pkl"
    with open(p, "wb") as f:
        pickle.dump(tensors, f)
    (tmp_path / "server_metadata.jsonl").write_text(
        json.dumps({"doc_index": 0, "rid": "up", "filename": p.name, "n_prompt_blocks": 9}) + "\n"
    )
    with pytest.raises(DumpFormatError, match="allow_pickle"):
        load_doc(p)
    back = load_doc(p, allow_pickle=True)
    assert back.rid == "up" and back.labels.to_rows() == doc.labels.to_rows()
    assert list_docs(tmp_path) == [p]


def test_list_and_metadata(tmp_path):
    w = DumpWriter(tmp_path)
    for i in (0, 1):
        w.commit(make_doc(i), item_index=i, source="x.jsonl")
    save_doc_file(tmp_path / "doc_00002.safetensors", make_doc(2))  # on disk but never committed
    with open(tmp_path / "server_metadata.jsonl", "a") as f:
        f.write('{"doc_index": 2, "filen')  # torn last line
    assert [p.name for p in list_docs(tmp_path)] == ["doc_00000.safetensors", "doc_00001.safetensors"]
    meta = read_metadata(tmp_path)
    assert [m["doc_index"] for m in meta] == [0, 1]
    m = meta[1]
    assert m["filename"] == "doc_00001.safetensors" and m["n_decode_tokens"] == 9
    assert m["n_total_labels"] == int(make_doc(1).label_indices.numel())
    assert m["hidden_shapes"] == {"1": [9, 8], "3": [9, 8]} and m["compk_shapes"]["3"] == [11, 20]
    assert m["target_csa_layers"] == [1, 3] and len(m["logits_shapes"]) == 6
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "server_metadata.jsonl").write_text(
        '{"doc_index": 0, "filename": "a"}\nnot json\n{"doc_index": 1, "filename": "b"}\n'
    )
    with pytest.raises(DumpFormatError, match="server_metadata.jsonl:2"):
        read_metadata(bad)
