"""The output directory is checked, locked, and never loses a document."""

import errno
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashmemory.dump import DumpWriter, list_docs, load_doc, read_metadata
from flashmemory.dump.errors import DumpOutputError
from flashmemory.dump.writer import save_doc_file

from .synth import make_doc

ROOT = Path(__file__).resolve().parents[2]


def _commit(w, i, source="a.jsonl"):
    d = make_doc(i, seed=i)
    d.rid = f"{source}:{i}"
    return w.commit(d, item_index=i, source=source)


def test_missing_metadata_deletes_nothing(tmp_path):
    """#2: with server_metadata.jsonl gone, complete docs are adopted (not removed); upstream .pkl is left alone."""
    with DumpWriter(tmp_path) as w:
        for i in range(3):
            _commit(w, i)
    before = {p.name: p.read_bytes() for p in tmp_path.glob("doc_*")}
    (tmp_path / "server_metadata.jsonl").unlink()
    (tmp_path / "doc_00007.pkl").write_bytes(b"upstream bytes")  # an upstream file: never ours to touch
    with DumpWriter(tmp_path) as w:
        notes = " | ".join(w.recovered)
        assert notes.count("adopted") == 3 and "left doc_00007.pkl alone" in notes
        assert w.done_items("a.jsonl") == {0, 1, 2} and w.next_doc_index == 8
    for name, data in before.items():
        assert (tmp_path / name).read_bytes() == data
    assert (tmp_path / "doc_00007.pkl").read_bytes() == b"upstream bytes"
    assert [r["doc_index"] for r in read_metadata(tmp_path)] == [0, 1, 2]


def test_an_unloadable_unlisted_doc_is_moved_aside_not_deleted(tmp_path):
    with DumpWriter(tmp_path) as w:
        _commit(w, 0)
    save_doc_file(tmp_path / "doc_00001.safetensors", make_doc(1))
    data = (tmp_path / "doc_00001.safetensors").read_bytes()
    (tmp_path / "doc_00001.safetensors").write_bytes(data[:-10])  # cut: it cannot be adopted
    with DumpWriter(tmp_path) as w:
        assert any("moved doc_00001.safetensors to .quarantine/" in n for n in w.recovered)
    assert (tmp_path / ".quarantine" / "doc_00001.safetensors").read_bytes() == data[:-10]
    assert [p.name for p in list_docs(tmp_path)] == ["doc_00000.safetensors"]


def test_a_truncated_committed_doc_is_detected_moved_aside_and_redone(tmp_path):
    """#11: the size recorded at commit (and the file's own header) catch a committed doc cut afterwards."""
    with DumpWriter(tmp_path) as w:
        for i in range(2):
            _commit(w, i)
    assert all(r["file_size"] == (tmp_path / r["filename"]).stat().st_size for r in read_metadata(tmp_path))
    p = tmp_path / "doc_00001.safetensors"
    whole = p.read_bytes()
    p.write_bytes(whole[: len(whole) - 100])
    with DumpWriter(tmp_path) as w:
        assert any("doc 1" in n and "damaged" in n and "truncated" in n for n in w.recovered), w.recovered
        assert w.done_items("a.jsonl") == {0}  # item 1 will be redone
        _commit(w, 1)
    assert (tmp_path / ".quarantine" / "doc_00001.safetensors").stat().st_size == len(whole) - 100
    assert [load_doc(q).doc_index for q in list_docs(tmp_path)] == [0, 1]


def test_an_appended_to_doc_is_caught_by_the_recorded_size(tmp_path):
    with DumpWriter(tmp_path) as w:
        _commit(w, 0)
    with open(tmp_path / "doc_00000.safetensors", "ab") as f:
        f.write(b"junk")
    with DumpWriter(tmp_path) as w:
        assert any("damaged" in n for n in w.recovered) and w.done_items("a.jsonl") == set()


def test_an_unlocked_runs_duplicates_are_repaired(tmp_path):
    """#3 / #9: what two unlocked shards left (doc_index 0 twice, one file): the line matching the file stays."""
    with DumpWriter(tmp_path) as w:
        _commit(w, 0, "a.jsonl")
    good = read_metadata(tmp_path)[0]
    ghost = {**good, "rid": "a.jsonl:5", "item_index": 5}  # the other shard's line, file overwritten
    meta = tmp_path / "server_metadata.jsonl"
    meta.write_text(json.dumps(ghost) + "\n" + json.dumps(good) + "\n" + json.dumps(good) + "\n")
    from flashmemory.dump import DumpFormatError

    with pytest.raises(DumpFormatError, match="lines 1 and 2 both claim doc_index 0"):
        read_metadata(tmp_path)  # readers refuse, naming the lines
    with DumpWriter(tmp_path) as w:
        notes = " | ".join(w.recovered)
        assert "rid 'a.jsonl:5'" in notes and "repeated line" in notes
        assert w.done_items("a.jsonl") == {0}  # item 5 is not "done": it is redone
    assert read_metadata(tmp_path) == [good]


def test_output_dir_that_is_a_file_or_unwritable(tmp_path, monkeypatch):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(DumpOutputError, match="file: --output-dir is a file, not a directory"):
        DumpWriter(f)
    real_open = open

    def refuse(path, *a, **k):
        if "-probe." in str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", refuse)  # root ignores mode bits: refuse here
    with pytest.raises(DumpOutputError, match="out: output directory is not writable \\(Permission denied\\)"):
        DumpWriter(tmp_path / "out")


def test_full_disk_is_an_oserror_naming_the_file_and_leaves_no_temp(tmp_path, monkeypatch):
    import safetensors.torch as sst

    class SafetensorError(Exception):  # what safetensors raises for a full disk (not an OSError)
        pass

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"part")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(sst, "save_file", full)
    with DumpWriter(tmp_path) as w:
        with pytest.raises(OSError) as e:
            _commit(w, 0)
    assert e.value.errno == errno.ENOSPC and e.value.filename.endswith("doc_00000.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".dump.lock"]


def test_second_writer_in_another_process_is_refused_with_the_holders_pid(tmp_path):
    """#3: a second process gets one line naming the directory and the holder's pid."""
    code = (
        "import sys, time; from flashmemory.dump import DumpWriter; w = DumpWriter(sys.argv[1]); "
        "print('held', flush=True); time.sleep(30)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DumpOutputError, match=rf"locked by another dump writer \(pid {holder.pid}\)"):
            DumpWriter(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    DumpWriter(tmp_path).close()  # the lock died with its process


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n_a=st.integers(1, 4), n_b=st.integers(1, 4), pause=st.floats(0, 0.02))
def test_two_concurrent_writers_lose_nothing(tmp_path_factory, n_a, n_b, pause):
    """Property: two writers (threads, each a shard that waits for the lock) on one directory: every document
    of both lands exactly once, doc_index is unique, every line's file loads."""
    d = tmp_path_factory.mktemp("conc")
    errors = []

    def shard(source, n):
        try:
            while True:
                try:
                    w = DumpWriter(d)
                    break
                except DumpOutputError as e:
                    assert "locked by another dump writer" in str(e)
                    time.sleep(0.005)
            with w:
                done = w.done_items(source)
                for i in range(n):
                    if i not in done:
                        doc = make_doc(w.next_doc_index, T=3, seed=i)
                        doc.rid = f"{source}:{i}"
                        w.commit(doc, item_index=i, source=source)
                        time.sleep(pause)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=shard, args=("a.jsonl", n_a)), threading.Thread(target=shard, args=("b.jsonl", n_b))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    meta = read_metadata(d)
    assert sorted((r["source"], r["item_index"]) for r in meta) == sorted(
        [("a.jsonl", i) for i in range(n_a)] + [("b.jsonl", i) for i in range(n_b)]
    )
    assert len({r["doc_index"] for r in meta}) == len(meta) == n_a + n_b
    assert [load_doc(p).rid for p in list_docs(d)] == [r["rid"] for r in meta]
