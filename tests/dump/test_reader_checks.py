"""What every dump reader (train, eval, verify) refuses, with the file and field."""

import json
import shutil

import pytest

from flashmemory.cli import main
from flashmemory.dump import DumpFormatError, DumpWriter, list_docs, load_doc, read_metadata
from flashmemory.dump.writer import doc_tensors, save_doc_file
from flashmemory.train.data_config import DataConfigError, DataSpec
from flashmemory.train.dataset import resolve_docs

from .synth import make_doc


def _raw_save(path, doc):
    """Write a doc file without the writer's validation (what a foreign or corrupted writer could leave)."""
    from safetensors.torch import save_file

    tensors, meta = doc_tensors(doc)
    save_file(tensors, str(path), metadata=meta)
    return path


@pytest.mark.parametrize("where", ["hidden", "logits", "topk"])
def test_non_finite_values_are_caught_where_they_enter(tmp_path, where):
    doc = make_doc(0)
    if where == "topk":
        from .test_topk_store import add_topk

        doc = add_topk(doc, [0, 4], k=3, n_layers=2)
        doc.native_topk[1][1][1, 0] = float("inf")
        want = r"doc_00000.safetensors: native_topk_idx_layer_1: ids must be >= 0 exactly where the value is a finite"
    elif where == "hidden":
        doc.hidden[3][4, 2] = float("nan")
        want = r"doc_00000.safetensors: hidden_layer_3: 1 non-finite value\(s\) \(NaN/Inf\), first in row 4"
    else:
        doc.native_logits[(1, 2)][0] = float("inf")
        want = r"doc_00000.safetensors: logits_layer_1_token_2: 1 non-finite"
    with pytest.raises(DumpFormatError, match=want):  # the writer refuses it ...
        save_doc_file(tmp_path / "doc_00000.safetensors", doc)
    assert not list(tmp_path.iterdir())
    p = _raw_save(tmp_path / "doc_00000.safetensors", doc)
    with pytest.raises(DumpFormatError, match=want):  # ... and so does every reader
        load_doc(p)


def _outside_dump(tmp_path, filename):
    d = tmp_path / "dump"
    with DumpWriter(d) as w:
        w.commit(make_doc(0))
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(d / "doc_00000.safetensors", other / "doc_00001.safetensors")
    line = {**read_metadata(d)[0], "doc_index": 1, "filename": filename}
    with open(d / "server_metadata.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    return d


@pytest.mark.parametrize("name", ["../other/doc_00001.safetensors", "ABS", "sub/doc_00001.safetensors", ".."])
def test_metadata_filename_outside_the_dump_dir_is_refused(tmp_path, name):
    name = str(tmp_path / "other" / "doc_00001.safetensors") if name == "ABS" else name
    d = _outside_dump(tmp_path, name)
    with pytest.raises(DumpFormatError, match=r"server_metadata.jsonl:2: filename .* is outside the dump directory"):
        list_docs(d)
    with pytest.raises(DumpFormatError, match="outside the dump directory"):  # the train reader
        resolve_docs([DataSpec(d)], "train split")


def test_eval_and_verify_refuse_an_outside_filename_too(tmp_path, teacher, capsys):
    from flashmemory.retriever.checkpoint import save_retriever
    from flashmemory.train.synthetic import write_synthetic_dump

    d = tmp_path / "dump"
    write_synthetic_dump(d, teacher, n_docs=1, seed=0)
    line = {**read_metadata(d)[0], "doc_index": 1, "filename": "../elsewhere/doc_00001.safetensors"}
    with open(d / "server_metadata.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    ck = save_retriever(teacher, tmp_path / "t.safetensors")
    for argv in (
        ["eval", "--checkpoint", str(ck), "--dump", str(d)],
        ["verify", "--checkpoint", str(ck), "--dump", str(d)],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "server_metadata.jsonl:2: filename '../elsewhere/doc_00001.safetensors' is outside" in err, err


def test_a_repeated_metadata_line_counts_once_and_a_conflicting_one_is_an_error(tmp_path):
    with DumpWriter(tmp_path) as w:
        w.commit(make_doc(0))
    meta = tmp_path / "server_metadata.jsonl"
    line = meta.read_text()
    meta.write_text(line * 2)
    assert len(read_metadata(tmp_path)) == 1 and len(list_docs(tmp_path)) == 1
    other = json.loads(line)
    other["rid"] = "someone else"
    meta.write_text(line + json.dumps(other) + "\n")
    with pytest.raises(DumpFormatError, match="lines 1 and 2 both claim doc_index 0"):
        list_docs(tmp_path)
    renamed = {**json.loads(line), "doc_index": 5}  # one file under two doc indices
    meta.write_text(line + json.dumps(renamed) + "\n")
    with pytest.raises(DumpFormatError, match="both claim filename 'doc_00000.safetensors'"):
        list_docs(tmp_path)


def test_data_config_doc_ids_without_a_doc_are_an_error(tmp_path):
    with DumpWriter(tmp_path) as w:
        for i in range(3):
            w.commit(make_doc(i))
    assert [p.name for p in resolve_docs([DataSpec(tmp_path, (0, 2))])] == [
        "doc_00000.safetensors",
        "doc_00002.safetensors",
    ]
    with pytest.raises(DataConfigError, match=r"val split: .*: doc_ids 3, 7 have no complete document"):
        resolve_docs([DataSpec(tmp_path, (0, 3, 7))], "val split")


def test_doc_index_and_filename_types_in_metadata_are_checked(tmp_path):
    meta = tmp_path / "server_metadata.jsonl"
    for line, msg in [
        ({"doc_index": "0", "filename": "doc_00000.safetensors"}, "doc_index='0' is not an integer"),
        ({"doc_index": -1, "filename": "doc_00000.safetensors"}, "doc_index=-1"),
        ({"doc_index": 0, "filename": 5}, "filename 5 is outside"),
    ]:
        meta.write_text(json.dumps(line) + "\n\n")
        with pytest.raises(DumpFormatError, match=msg):
            read_metadata(tmp_path)


def test_eval_doc_ids_without_a_doc_are_an_error(tmp_path, teacher, capsys):
    from flashmemory.retriever.checkpoint import save_retriever
    from flashmemory.train.synthetic import write_synthetic_dump

    d = tmp_path / "dump"
    write_synthetic_dump(d, teacher, n_docs=2, seed=0)
    ck = save_retriever(teacher, tmp_path / "t.safetensors")
    assert main(["eval", "--checkpoint", str(ck), "--dump", str(d), "--doc-ids", "1,4"]) == 2
    assert "--doc-ids 4 have no complete document" in capsys.readouterr().err
