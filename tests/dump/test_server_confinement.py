"""The dump server (`flashmemory.sglang.dump.mode.DumpRecorder`) writes only inside its root, and
refuses at admission, with the reason, a document it could not write. Each test names the promise it protects
(data_generation/README.md: "The server only writes where its operator allows"; README "Errors and data
safety": one clear line naming the file or field) and fails on the code before the fix."""

import logging
import os

import pytest
import torch

from flashmemory.dump.confine import ConfineError, relative_parts
from flashmemory.dump.format import load_doc
from flashmemory.dump.protocol import DumpProtocolError, DumpRequest
from flashmemory.retriever.fp8 import quantize_chunks
from flashmemory.sglang.dump.mode import DumpRecorder


def _feed(rec, rid, steps=3, prompt=40, n_layers=2, finish=True):
    """What the indexer hook hands the recorder for one admitted request: every c4 layer, every decode step."""
    g = torch.Generator().manual_seed(0)
    kv = quantize_chunks(torch.randn(64, 128, generator=g))
    for t in range(steps):
        rec.begin_step([rid])
        pos = prompt + t
        n = (pos + 1) // 4
        for L in range(n_layers):
            lg = torch.randn(1, 32, generator=g)
            lg[:, n:] = float("-inf")
            rec.observe_layer(
                L,
                [rid],
                lg,
                torch.tensor([n]),
                torch.tensor([pos]),
                hidden=torch.randn(1, 8, generator=g),
                new_chunks=lambda b, s, e: kv[s:e],
            )
    if finish:
        rec.begin_step([])  # the request is gone: finalized


def _req(out, doc_index=0, pass_=1):
    return DumpRequest(pass_=pass_, doc_index=doc_index, output_dir=str(out), min_layers=1, target_csa_layers=(1,))


def _tree(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    return root, outside


def _admit(rec, rid, req):
    """(admitted, refusal message or '')."""
    try:
        return rec.admit(rid, req.to_custom_params()), ""
    except DumpProtocolError as e:
        return False, str(e)


def _all_files(d):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())


def test_a_pass_subdirectory_that_is_a_symlink_out_is_refused_at_admission(tmp_path):
    """Promise: "The server only writes where its operator allows" (DUMP_ROOT). output_dir is inside the root,
    but its pass1/ is a symlink to outside: it used to be admitted and the document written outside."""
    root, outside = _tree(tmp_path)
    (root / "run").mkdir()
    (root / "run" / "pass1").symlink_to(outside, target_is_directory=True)
    rec = DumpRecorder(index_topk=8, root=root)
    admitted, why = _admit(rec, "r1", _req(root / "run"))
    if admitted:
        _feed(rec, "r1")
    assert _all_files(outside) == []
    assert not admitted and not rec.pending
    assert why == (
        f"request r1: flashmemory_dump.output_dir='{root / 'run'}': {root.resolve() / 'run' / 'pass1'}: "
        "is a symlink (dump writes never follow symlinks below the root)"
    )


@pytest.mark.parametrize("swap", ["output_dir", "pass1"])
def test_a_directory_swapped_for_a_symlink_after_admission_is_not_followed(tmp_path, caplog, swap):
    """Promise: "The server only writes where its operator allows". A directory admitted inside the root and
    replaced by a symlink to outside before the document is finalised used to be followed at the write."""
    root, outside = _tree(tmp_path)
    run = root / "run"
    rec = DumpRecorder(index_topk=8, root=root)
    req = _req(run)
    assert rec.admit("r1", req.to_custom_params())
    _feed(rec, "r1", finish=False)
    victim = run if swap == "output_dir" else run / "pass1"
    victim.mkdir(parents=True, exist_ok=True)
    victim.rename(victim.with_name(victim.name + ".moved"))  # swapped while the request decodes
    victim.symlink_to(outside, target_is_directory=True)
    if swap == "output_dir":
        (outside / "pass1").mkdir()
    with caplog.at_level(logging.ERROR):
        rec.begin_step([])  # finalized now
    assert _all_files(outside) == []
    assert rec.failed == ["r1"] and rec.written == []
    assert "request r1: document not written" in caplog.text and "is a symlink" in caplog.text


def test_a_directory_replaced_by_another_after_admission_is_refused(tmp_path, caplog):
    """Promise as above: the write goes to the directory admitted, or nowhere (a new directory at the same path,
    e.g. a second client run that cleared the staging area, is not the one this request was admitted for)."""
    root, _ = _tree(tmp_path)
    rec = DumpRecorder(index_topk=8, root=root)
    assert rec.admit("r1", _req(root / "run").to_custom_params())
    (root / "run" / "pass1").rename(root / "run" / "old")
    (root / "run" / "pass1").mkdir()
    with caplog.at_level(logging.ERROR):
        _feed(rec, "r1")
    assert rec.failed == ["r1"] and "not the directory admitted for request r1" in caplog.text
    assert _all_files(root) == []


@pytest.mark.parametrize(
    "case", ["name too long", "file for output_dir", "file for pass1", "dir for the doc", "symlink for the doc"]
)
def test_a_document_that_cannot_be_written_is_refused_at_admission_with_the_reason(tmp_path, case):
    """Promise (README "Errors and data safety"): an expected failure is one clear line naming the file or
    field, here the client's HTTP 400. Such a document used to be admitted, run, and only logged at
    finalisation, so the client waited for a file that never came."""
    root, outside = _tree(tmp_path)
    run, doc_index = root / "run", 0
    if case == "name too long":
        doc_index = 10**250
    elif case == "file for output_dir":
        run.write_text("a user's file")
    elif case == "file for pass1":
        run.mkdir()
        (run / "pass1").write_text("x")
    elif case == "dir for the doc":
        (run / "pass1" / "doc_00000.safetensors").mkdir(parents=True)
    else:
        (run / "pass1").mkdir(parents=True)
        (run / "pass1" / "doc_00000.safetensors").symlink_to(outside / "x")
    rec = DumpRecorder(index_topk=8, root=root)
    admitted, why = _admit(rec, "r3", _req(run, doc_index))
    if admitted:
        _feed(rec, "r3")
    assert not admitted and not rec.pending and why.startswith("request r3: flashmemory_dump.")
    want = {
        "name too long": "file name too long",
        "file for output_dir": "run: is a file where a directory should be",
        "file for pass1": "pass1: is a file where a directory should be",
        "dir for the doc": "doc_00000.safetensors: exists and is a directory",
        "symlink for the doc": "doc_00000.safetensors: exists and is a symlink",
    }[case]
    assert want in why, why
    assert _all_files(outside) == [] and len(why.splitlines()) == 1


@pytest.mark.sglang
def test_the_refusal_reaches_the_client_as_the_abort_reason(tmp_path, monkeypatch):
    """Promise as above, through the scheduler hook: sglang's own abort carries the reason (HTTP 400)."""
    from types import SimpleNamespace

    from flashmemory.sglang.decode import hooks

    root, _ = _tree(tmp_path)
    (root / "run").write_text("x")
    rec = DumpRecorder(index_topk=8, root=root)
    monkeypatch.setattr(hooks.RUNTIME, "dump", rec)
    aborted = []
    req = SimpleNamespace(
        rid="r5",
        set_finish_with_abort=aborted.append,
        sampling_params=SimpleNamespace(custom_params=_req(root / "run").to_custom_params()),
    )
    hooks.before_add_request(None, req)
    assert len(aborted) == 1 and "request r5" in aborted[0] and "is a file where a directory should be" in aborted[0]
    assert not rec.pending


def _four_refusals(root):
    """Four admission refusals that quote the path the OS saw, each with a newline in the client's output_dir: a
    file where a directory should be, a symlink below the root, a component too long, the document's name taken."""
    (root / "f\nx").write_text("x")
    (root / "l\nx").symlink_to(root, target_is_directory=True)
    (root / "d\nx" / "pass1" / "doc_00000.safetensors").mkdir(parents=True)
    return {
        "file": (root / "f\nx" / "run", "is a file where a directory should be"),
        "symlink": (root / "l\nx" / "run", "is a symlink (dump writes never follow symlinks below the root)"),
        "long": (root / ("a\n" + "x" * 300), "File name too long"),
        "taken": (root / "d\nx", "exists and is a directory, so the document cannot be written"),
    }


@pytest.mark.sglang
@pytest.mark.parametrize("case", ["file", "symlink", "long", "taken"])
def test_a_refusal_is_one_line_in_the_log_and_to_the_client(tmp_path, monkeypatch, case):
    """A refusal quoted the OS's path raw: an output_dir with a newline split the server's log line (sglang logs the
    abort reason) and the client's HTTP 400 message in two. Now every refusal is one line, through the scheduler
    hook, with sglang's own abort (HTTP 400, the default of `set_finish_with_abort`)."""
    from types import SimpleNamespace

    from flashmemory.sglang.decode import hooks

    root, _ = _tree(tmp_path)
    out, why = _four_refusals(root)[case]
    rec = DumpRecorder(index_topk=8, root=root)
    monkeypatch.setattr(hooks.RUNTIME, "dump", rec)
    aborted = []
    req = SimpleNamespace(
        rid="r7",
        set_finish_with_abort=lambda msg, **kw: aborted.append((msg, kw)),
        sampling_params=SimpleNamespace(custom_params=_req(out).to_custom_params()),
    )
    hooks.before_add_request(None, req)
    assert len(aborted) == 1 and aborted[0][1] == {} and not rec.pending, aborted
    msg = aborted[0][0]
    assert msg.startswith("FlashMemory dump: request r7: flashmemory_dump.") and why in msg, msg
    assert len(msg.splitlines()) == 1 and "\\n" in msg, msg


def test_confined_writes_still_write_documents_atomically(tmp_path):
    """The confined path writes what the plain one did: a whole, loadable document, mode 0644, no temp left."""
    root, _ = _tree(tmp_path)
    rec = DumpRecorder(index_topk=8, root=root)
    for i, p in enumerate((1, 2)):
        req = _req(root / "a" / "b", doc_index=7, pass_=p)
        assert rec.admit(f"r{i}", req.to_custom_params())
        _feed(rec, f"r{i}", steps=3 if p == 1 else 2)
    assert rec.failed == [] and rec.written == [str(_req(root / "a" / "b", 7, p).doc_path()) for p in (1, 2)]
    assert _all_files(root) == ["a/b/pass1/doc_00007.safetensors", "a/b/pass2/doc_00007.safetensors"]
    doc = load_doc(root / "a" / "b" / "pass1" / "doc_00007.safetensors")
    assert doc.doc_index == 7 and doc.n_tokens == 3
    assert oct(os.stat(root / "a" / "b" / "pass1" / "doc_00007.safetensors").st_mode & 0o777) == "0o644"


def test_relative_parts_is_lexical_and_stays_below_the_root(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    assert relative_parts(str(root / "a" / "b"), str(root)) == ["a", "b"]
    assert relative_parts(str(root), str(root)) == []
    for bad in (str(tmp_path / "rootx" / "a"), "/etc", str(tmp_path)):
        with pytest.raises(ConfineError, match="outside the dump root"):
            relative_parts(bad, str(root))


def test_a_refusal_reaches_the_client_whole_on_one_line(tmp_path):
    """The server's refusal of a bad output_dir (HTTP 400, sglang's error body) reached the client as the first 300
    bytes of the raw body (`b'{"object": "error", ...`): after a long output_dir the reason itself was cut off. Now
    the client shows the message, whole, on one line."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from flashmemory.dump.backend import DumpItemError
    from flashmemory.dump.sglang_backend import SGLangBackend

    root, _ = _tree(tmp_path)
    (root / "afile").write_text("x")
    long_dir = root / "afile" / ("d" * 200) / "run"
    rec = DumpRecorder(index_topk=8, root=root)
    admitted, why = _admit(rec, "r1", _req(long_dir))
    assert not admitted and why.endswith("is a file where a directory should be"), why

    class Refuse(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):  # what sglang sends for a request its scheduler aborted with the hook's reason
            self.rfile.read(int(self.headers["Content-Length"]))
            body = {"object": "error", "message": f"FlashMemory dump: {why}", "type": "BadRequestError", "code": 400}
            data = json.dumps(body).encode()
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        be = object.__new__(SGLangBackend)  # the request path only
        be.url, be.model, be.thinking, be.timeout = f"http://127.0.0.1:{srv.server_address[1]}/v1", "m", False, 10.0
        with pytest.raises(DumpItemError) as e:
            be._chat([{"role": "user", "content": "hi"}], 4, _req(long_dir))
    finally:
        srv.shutdown()
        srv.server_close()
    msg = str(e.value)
    assert e.value.permanent and msg == f"server answered HTTP 400: FlashMemory dump: {why}", msg
    assert "\n" not in msg and "b'" not in msg
