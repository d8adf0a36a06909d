import pytest

from flashmemory.dump import DumpFormatError, DumpWriter, list_docs, load_doc, read_metadata

from .synth import make_doc


def test_recovery_after_crash(tmp_path):
    w = DumpWriter(tmp_path)
    w.commit(make_doc(0), item_index=0, source="a.jsonl")
    w.commit(make_doc(1), item_index=1, source="a.jsonl")
    # What a crash can leave: a temp file, a renamed doc without its line, a torn line, a line without a file.
    from flashmemory.dump.outdir import tmp_name

    (tmp_path / tmp_name("doc_00002.safetensors", 123)).write_bytes(b"partial")
    from flashmemory.dump.writer import save_doc_file

    save_doc_file(tmp_path / "doc_00003.safetensors", make_doc(3))
    (tmp_path / "doc_00001.safetensors").unlink()
    with open(tmp_path / "server_metadata.jsonl", "a") as f:
        f.write('{"doc_index": 3, "rid"')
    w.close()
    w2 = DumpWriter(tmp_path)
    notes = " | ".join(w2.recovered)
    assert "stray temp" in notes and "doc_00003" in notes and "doc 1" in notes
    assert "adopted doc_00003" in notes  # complete and valid: kept, never deleted
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".dump.lock",
        "doc_00000.safetensors",
        "doc_00003.safetensors",
        "server_metadata.jsonl",
    ]
    assert [r["doc_index"] for r in read_metadata(tmp_path)] == [0, 3]
    assert (tmp_path / "server_metadata.jsonl").read_text().endswith("}\n")
    assert w2.done_items("a.jsonl") == {0} and w2.done_items("b.jsonl") == set()
    assert w2.next_doc_index == 4
    w2.commit(make_doc(1), item_index=1, source="a.jsonl")
    assert [load_doc(p).doc_index for p in list_docs(tmp_path)] == [0, 1, 3]


def test_no_double_commit(tmp_path):
    w = DumpWriter(tmp_path)
    w.commit(make_doc(0))
    with pytest.raises(DumpFormatError, match="already committed"):
        w.commit(make_doc(0))


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import safetensors.torch as st

    def boom(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(st, "save_file", boom)
    w = DumpWriter(tmp_path)
    with pytest.raises(OSError, match="disk full"):
        w.commit(make_doc(0))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".dump.lock"]
