"""The held-out probe's findings in the dump pipeline. Each test names the promise of the README's
"Errors and data safety" section (or data_generation/README.md "Robustness") that it protects, and fails on
the code before its fix."""

import json

import pytest
import torch

from flashmemory.cli import main
from flashmemory.dump import DumpFormatError, DumpWriter, list_docs, load_doc, read_metadata
from flashmemory.dump.backend import DumpConfig
from flashmemory.dump.client import run_dump
from flashmemory.dump.outdir import is_own_tmp, tmp_name
from flashmemory.dump.writer import doc_tensors

from . import test_sglang_backend
from .synth import make_doc
from .test_client import FakeBackend

server = test_sglang_backend.server  # the stand-in dump server fixture, found by pytest under this name


def _lines(path, prompts):
    path.write_text(
        "".join(json.dumps({"prompt": json.dumps([{"role": "user", "content": q}])}) + "\n" for q in prompts)
    )
    return path


# --- 1. data loss: a user's .tmp-* file ---------------------------------------------------------------------
def test_resume_never_deletes_a_users_tmp_file(tmp_path):
    """Promise: "Nothing is deleted that the project did not write as a temporary file." Recovery used to
    delete every `.tmp-*` name ("removed stray temp file .tmp-notes.txt"); now only names whose tag it
    verifies (`tmp_name`), so a user's file survives and the project's own crash debris is still cleaned."""
    with DumpWriter(tmp_path) as w:
        w.commit(make_doc(0))
    user = {
        ".tmp-notes.txt": b"my notes",
        ".tmp-doc_00009.safetensors.77": b"mine too",
        tmp_name("doc_00001.safetensors", 123).replace("fm", "fmx", 1): b"forged tag",
    }
    for name, data in user.items():
        (tmp_path / name).write_bytes(data)
    own = tmp_name("doc_00001.safetensors", 123)
    (tmp_path / own).write_bytes(b"crash debris")
    with DumpWriter(tmp_path) as w:
        notes = " | ".join(w.recovered)
    for name, data in user.items():
        assert (tmp_path / name).read_bytes() == data, name  # untouched
    assert not (tmp_path / own).exists() and f"removed stray temp file {own}" in notes
    assert ".tmp-notes.txt" not in notes and "left .tmp-doc_00009.safetensors.77 alone" in notes
    assert is_own_tmp(own) and not any(is_own_tmp(n) for n in user)


# --- 2. resume keyed on the input's content, not its name --------------------------------------------------
def test_resume_with_another_file_of_the_same_name_dumps_it(tmp_path, capsys):
    """Promise: a resumed run continues only the same work (README: an output dir holding a run is continued,
    never silently taken for another; data_generation "A re-run skips items already complete"). A different
    input file with the same base name used to report "2 already done" and dump nothing."""
    out, cfg = tmp_path / "out", DumpConfig(target_layers=(1, 3))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = _lines(tmp_path / "a" / "in.jsonl", ["q0", "q1"])
    other = _lines(tmp_path / "b" / "in.jsonl", ["other 0", "q1", "other 2"])
    assert len(run_dump(FakeBackend(), first, out, cfg, progress=False).committed) == 2
    fb = FakeBackend()
    rep = run_dump(fb, first, out, cfg, progress=False)  # the same file: nothing to do
    assert fb.seen == [] and rep.skipped_done == 2
    fb = FakeBackend()
    rep = run_dump(fb, other, out, cfg, progress=False)
    err = capsys.readouterr().err
    assert fb.seen == [0, 2] and rep.skipped_done == 1 and rep.changed == [0]  # item 1 is the same prompt
    assert "1 item(s) of in.jsonl (items 0) differ from the documents dumped for them" in err
    assert "the earlier documents stay" in err
    meta = read_metadata(out)
    assert len(meta) == 4 and all(len(r["item_sha256"]) == 64 for r in meta)
    assert [load_doc(p).doc_index for p in list_docs(out)] == [0, 1, 2, 3]


def test_resume_of_an_older_dump_without_hashes_says_so(tmp_path, capsys):
    """Promise as above, for dumps written before the content hash: they count as done by name and index
    (backward compatible), and the message says that this is all that was checked."""
    out, cfg = tmp_path / "out", DumpConfig(target_layers=(1, 3))
    inp = _lines(tmp_path / "in.jsonl", ["q0", "q1"])
    run_dump(FakeBackend(), inp, out, cfg, progress=False)
    meta = out / "server_metadata.jsonl"
    old = [{k: v for k, v in json.loads(x).items() if k != "item_sha256"} for x in meta.read_text().splitlines()]
    meta.write_text("".join(json.dumps(r) + "\n" for r in old))
    capsys.readouterr()
    fb = FakeBackend()
    rep = run_dump(fb, inp, out, cfg, progress=False)
    assert fb.seen == [] and rep.skipped_done == 2 and rep.legacy_done == [0, 1]
    assert "taken as done by file name and index only" in capsys.readouterr().err


def test_a_failure_of_changed_content_is_not_skipped(tmp_path):
    """Promise as above: `failed_items.jsonl` skips an item only while its content is the one that failed."""
    out, cfg = tmp_path / "out", DumpConfig(target_layers=(1, 3))
    inp = _lines(tmp_path / "in.jsonl", ["q0", "bad"])
    rep = run_dump(FakeBackend(bad={1}), inp, out, cfg, progress=False)
    assert len(rep.failed) == 1
    rep = run_dump(FakeBackend(), inp, out, cfg, progress=False)
    assert rep.skipped_failed == [1]  # same content: skipped as before
    _lines(inp, ["q0", "fixed"])
    fb = FakeBackend()
    rep = run_dump(fb, inp, out, cfg, progress=False)
    assert fb.seen == [1] and not rep.skipped_failed and len(rep.committed) == 1


def test_a_document_adopted_after_a_crash_keeps_its_content_hash(tmp_path):
    """Promise as above, across a crash between the rename and the metadata append: the doc file's header
    carries `item_sha256`, so the adopted document still resumes by content, not only by name."""
    out, cfg = tmp_path / "out", DumpConfig(target_layers=(1, 3))
    inp = _lines(tmp_path / "in.jsonl", ["q0", "q1"])
    run_dump(FakeBackend(), inp, out, cfg, progress=False)
    meta = out / "server_metadata.jsonl"
    meta.write_text(meta.read_text().splitlines()[0] + "\n")  # item 1's line was never appended
    fb = FakeBackend()
    rep = run_dump(fb, inp, out, cfg, progress=False)
    assert any("adopted doc_00001" in n for n in rep.recovered)
    assert fb.seen == [] and rep.skipped_done == 2 and not rep.legacy_done
    from flashmemory.dump.inputs import load_items

    assert read_metadata(out)[1]["item_sha256"] == load_items(inp)[0][1].content_sha256()


# --- 5. --seed out of range ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [str(2**70), "-1"])
def test_dump_seed_out_of_range_names_the_flag(tmp_path, capsys, seed):
    """Promise: "Every numeric input is range-checked where it is read" and "One line, non-zero exit" naming
    the flag. `--seed 2**70` used to fail in torch with "Overflow when unpacking long long"."""
    inp = _lines(tmp_path / "in.jsonl", ["q0"])
    assert (
        main(
            [
                "dump",
                "--model",
                "micro",
                "--no-progress",
                "--input",
                str(inp),
                "--output-dir",
                str(tmp_path / "o"),
                "--seed",
                seed,
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"flashmemory dump: error: --seed {seed} must lie in [0, {2**63 - 1}] (2**63 - 1)"]
    assert not (tmp_path / "o").exists()


# --- 7. index keys and their fp8 scales: non-finite values caught where documents load ----------------------
def _raw_save(path, doc):
    from safetensors.torch import save_file

    tensors, meta = doc_tensors(doc)
    save_file(tensors, str(path), metadata=meta)
    return path


def _poison(compk, what, chunk=2):
    """compk [N, D+4] uint8 with one chunk's scale set to NaN / Inf, or one fp8 key byte set to NaN (0x7f)."""
    c = compk.clone()
    d = c.shape[1] - 4
    if what == "fp8":
        c[chunk, 3] = 0xFF
    else:
        c[chunk, d:] = torch.tensor([float(what)], dtype=torch.float32).view(torch.uint8)
    return c


@pytest.mark.parametrize(
    "what,msg",
    [
        ("nan", "1 non-finite fp8 chunk scale(s) (NaN/Inf), first in chunk 2"),
        ("inf", "1 non-finite fp8 chunk scale(s) (NaN/Inf), first in chunk 2"),
        ("fp8", "1 chunk(s) with a NaN fp8 key byte (0x7f/0xff), first in chunk 2"),
    ],
)
def test_non_finite_index_keys_are_caught_at_load(tmp_path, what, msg):
    """Promise: "Non-finite values are caught where they enter." Hidden states and logits were checked at
    load, index keys and their fp8 scales were not (a NaN scale scored NaN and silently gave F1 0.0)."""
    doc = make_doc(0)
    doc.compk[3] = _poison(doc.compk[3], what)
    p = _raw_save(tmp_path / "doc_00000.safetensors", doc)
    with pytest.raises(DumpFormatError) as e:
        load_doc(p)
    assert str(e.value) == f"{p}: compk_layer_3: {msg}"


def _poisoned_synth(tmp_path, teacher, what, doc=0):
    from flashmemory.train.synthetic import write_synthetic_dump

    d = tmp_path / "dump"
    paths = write_synthetic_dump(d, teacher, n_docs=2, seed=0)
    bad = load_doc(paths[doc])
    L = bad.target_layers[-1]
    bad.compk[L] = _poison(bad.compk[L], what)
    _raw_save(paths[doc], bad)
    return d, paths[doc], L


def test_eval_refuses_a_dump_with_nan_key_scales(tmp_path, teacher, capsys):
    """Promise: "Non-finite values are caught where they enter" and "One line, non-zero exit" naming the
    file and field. `eval` used to score such a dump as 0.000 and exit 0."""
    from flashmemory.retriever.checkpoint import save_retriever

    d, bad, L = _poisoned_synth(tmp_path, teacher, "nan", doc=1)
    ck = save_retriever(teacher, tmp_path / "t.safetensors")
    assert main(["eval", "--checkpoint", str(ck), "--dump", str(d), "--all-docs"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{bad}: compk_layer_{L}: 1 non-finite fp8 chunk scale(s)" in err[0], err


@pytest.mark.parametrize("split", ["train", "val"])
def test_train_names_the_document_with_non_finite_key_scales(tmp_path, teacher, capsys, split):
    """Promise: "Non-finite values are caught where they enter" (not as an unnamed "training diverged at
    step 1", nor as a validation F1 of 0.0 with exit 0), one line naming the file and the field."""
    d, bad, L = _poisoned_synth(tmp_path, teacher, "inf" if split == "train" else "nan")
    good = tmp_path / "good"
    from flashmemory.train.synthetic import write_synthetic_dump

    write_synthetic_dump(good, teacher, n_docs=1, seed=3)
    specs = {"train": [{"data_dir": str(d)}], "val": [{"data_dir": str(good)}]}
    if split == "val":
        specs = {"train": [{"data_dir": str(good)}], "val": [{"data_dir": str(d)}]}
    cfg = tmp_path / "data.json"
    cfg.write_text(json.dumps(specs))
    rc = main(
        [
            "train",
            "--data-config",
            str(cfg),
            "--no-pretrain",
            "--output-dir",
            str(tmp_path / "o"),
            "--n-heads",
            "4",
            "--q-lora-rank",
            "16",
            "--epochs",
            "1",
            "--batch-size",
            "2",
            "--device",
            "cpu",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"{bad}: compk_layer_{L}: 1 non-finite fp8 chunk scale(s)" in err and "diverged" not in err, err


# --- 8. invalid UTF-8 in the input --------------------------------------------------------------------------
def test_invalid_utf8_input_is_refused_naming_the_line(tmp_path):
    """Promise (data_generation/README.md "Robustness"): "malformed lines among good ones are reported with
    their line number and skipped", and README "One line ... naming the file". A line with an invalid
    byte used to be dumped with U+FFFD in place of the byte, without a word."""
    from flashmemory.dump.inputs import InputError, load_items

    p = tmp_path / "in.jsonl"
    p.write_bytes(
        json.dumps({"prompt": "fine"}).encode()
        + b"\n\n"
        + b'{"prompt": "caf\xe9 au lait"}\n'
        + b'{"prompt": "half a pair \\ud800 here"}\n'
    )
    items, bad = load_items(p)
    assert [it.item_index for it in items] == [0]
    assert bad[0] == (
        "in.jsonl:3: not valid UTF-8 (byte 0xe9 at byte 16 of the line); item skipped, never dumped "
        "with a replacement character"
    )
    assert bad[1].startswith("in.jsonl:4: message 0 content holds a lone surrogate (U+D800")
    lst = tmp_path / "in.json"
    lst.write_bytes(b'[\n {"prompt": "ok"},\n {"prompt": "\xff"}\n]')
    with pytest.raises(InputError, match=r"in.json:3: not valid UTF-8 \(byte 0xff at byte 14 of the line\)"):
        load_items(lst)
    assert not any("\ufffd" in m["content"] for it in items for m in it.messages)


def test_dump_reports_an_invalid_utf8_item_and_dumps_the_rest(tmp_path, capsys):
    """Promise as above, through `run_dump`: the bad line is named and skipped, the good ones are dumped."""
    p = tmp_path / "in.jsonl"
    good = json.dumps({"prompt": json.dumps([{"role": "user", "content": "q"}])}).encode()
    p.write_bytes(good + b"\n" + b'{"prompt": "\xc3("}\n' + good + b"\n")
    rep = run_dump(FakeBackend(), p, tmp_path / "out", DumpConfig(target_layers=(1, 3)), progress=False)
    assert len(rep.committed) == 2 and len(rep.bad_input) == 1
    assert "skipping malformed input in.jsonl:2: not valid UTF-8 (byte 0xc3 at byte 13" in capsys.readouterr().err


def test_a_new_sglang_run_clears_only_the_servers_files_from_the_staging_area(tmp_path, server):
    """Promise: "Nothing is deleted that the project did not write as a temporary file." Starting an sglang
    dump used to `rmtree` `<output-dir>/.staging` whole, whatever was in it."""
    from flashmemory.dump.backend import DumpBackendError
    from flashmemory.dump.sglang_backend import SGLangBackend, clear_staging
    from flashmemory.dump.writer import save_doc_file

    out = tmp_path / "out"
    p1 = out / ".staging" / "pass1"
    p1.mkdir(parents=True)
    save_doc_file(p1 / "doc_00003.safetensors", make_doc(3))  # the server's, from a killed run
    (p1 / tmp_name("doc_00004.safetensors", 9)).write_bytes(b"torn")  # the server's temp file
    keep = {p1 / "notes.txt": b"mine", out / ".staging" / "README": b"mine", p1 / ".tmp-x": b"mine"}
    for f, data in keep.items():
        f.write_bytes(data)
    SGLangBackend(server, out)
    assert sorted(p.name for p in p1.iterdir()) == [".tmp-x", "notes.txt"]
    assert all(f.read_bytes() == data for f, data in keep.items())
    (p1 / "doc_00005.safetensors").write_bytes(b"not the server's")
    with pytest.raises(
        DumpBackendError,
        match=r"pass1/doc_00005.safetensors: in the dump staging area, but not a "
        r"file the dump server wrote \(never deleted\)",
    ):
        clear_staging(out / ".staging")
    assert (p1 / "doc_00005.safetensors").read_bytes() == b"not the server's"


# -- dump mode: an output directory unusable only at finalize is one line (server log and client), never a raw
#    exception or a timeout ----------------------------------------------------------------------------------


def _recorder_with_open_doc(tmp_path):
    from flashmemory.sglang.dump.mode import DumpRecorder

    from .test_server_confinement import _feed, _req

    root = tmp_path / "root"
    root.mkdir()
    rec = DumpRecorder(index_topk=8, root=root)
    req = _req(root / "run")
    assert rec.admit("r1", req.to_custom_params())
    _feed(rec, "r1", finish=False)
    return rec, req


def test_finalize_into_a_folder_at_the_documents_name_is_one_log_line(tmp_path, caplog):
    import logging

    rec, req = _recorder_with_open_doc(tmp_path)
    doc = req.doc_path()
    doc.mkdir(parents=True)
    (doc / "keep.txt").write_text("user data")  # the document's name, taken by a non-empty folder
    with caplog.at_level(logging.ERROR):
        rec.begin_step([])
    lines = [r.getMessage() for r in caplog.records if "not written" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert str(doc) in lines[0] and "OSError" not in lines[0] and "[Errno" not in lines[0]
    assert (doc / "keep.txt").read_text() == "user data" and rec.failed == ["r1"]


@pytest.mark.parametrize(
    "damage,why",
    [
        ("file", "is a file where a folder should be"),
        ("symlink", "is a symlink"),
        ("folder", "is a folder where the document file should be"),
    ],
)
def test_the_client_names_an_unusable_directory_at_once(tmp_path, damage, why):
    import time

    from flashmemory.dump.backend import DumpItemError
    from flashmemory.dump.sglang_backend import SGLangBackend

    be = object.__new__(SGLangBackend)  # no server: only the wait for its file is under test
    be.staging, be.flush_timeout = (tmp_path / "out" / "staging").resolve(), 5.0
    doc = be.staging / "pass1" / "doc_00000.safetensors"
    be.staging.mkdir(parents=True)
    if damage == "file":
        (be.staging / "pass1").write_text("x")
    elif damage == "symlink":
        (tmp_path / "elsewhere").mkdir()
        (be.staging / "pass1").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    else:
        doc.mkdir(parents=True)
    t = time.monotonic()
    with pytest.raises(DumpItemError, match=why) as e:
        be._wait(doc)
    assert time.monotonic() - t < 4 and "\n" not in str(e.value) and "pass1" in str(e.value)


def test_a_name_too_long_for_the_filesystem_is_named(tmp_path):
    from flashmemory.dump.confine import unusable

    long = tmp_path / ("x" * 300) / "pass1" / "doc_00000.safetensors"
    assert "name too long for the filesystem" in unusable(long, tmp_path)
    assert unusable(tmp_path / "fine" / "pass1" / "doc_00000.safetensors", tmp_path) is None
