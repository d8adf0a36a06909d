"""The sglang client against a local stand-in server that speaks the dump protocol."""

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from flashmemory.dump import list_docs, load_doc, read_metadata
from flashmemory.dump.cli import main
from flashmemory.dump.format import topk_store_steps
from flashmemory.dump.protocol import DumpProtocolError, DumpRequest
from flashmemory.dump.writer import save_doc_file

from .synth import make_doc
from .test_topk_store import add_topk

EX = "data_generation/example_data/tiny_chat.jsonl"


def with_topk(doc, req, k=6, n_layers=4):
    """What a dump-mode server stores for a pass-1 request: the native top-k at the steps req asks for."""
    steps = topk_store_steps(doc.n_tokens, req.store_topk, req.topk_interval)
    return add_topk(doc, steps.tolist(), k, n_layers, seed=doc.doc_index) if steps.numel() else doc


class StandIn(BaseHTTPRequestHandler):
    bodies: list = []
    old_server = False  # behave like a server that ignores store_topk (no top-k in pass 1)

    def log_message(self, *a):
        pass

    def _send(self, obj, code=200):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        models = self.path == "/v1/models"
        self._send({"data": [{"id": "stand-in"}]} if models else {}, 200 if models else 404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StandIn.bodies.append(body)
        req = DumpRequest.from_custom_params(body.get("custom_params"))
        req.doc_path().parent.mkdir(parents=True, exist_ok=True)
        if req.pass_ == 1:
            d = make_doc(req.doc_index, layers=req.target_csa_layers)
            save_doc_file(req.doc_path(), d if StandIn.old_server else with_topk(d, req))
            text = f"response {req.doc_index}"
        else:
            d = make_doc(req.doc_index, layers=req.target_csa_layers)
            d.compk = {L: torch.full((d.n_chunks + 1, 20), 7, dtype=torch.uint8) for L in d.compk}
            save_doc_file(req.doc_path(), d)
            text = "x"
        self._send({"choices": [{"message": {"role": "assistant", "content": text}}]})


@pytest.fixture
def server():
    StandIn.bodies = []
    StandIn.old_server = False
    srv = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


def test_two_pass_dump_via_stand_in(server, tmp_path):
    out = tmp_path / "out"
    rc = main(
        [
            "--backend",
            "sglang",
            "--url",
            server,
            "--input",
            EX,
            "--output-dir",
            str(out),
            "--n-samples",
            "3",
            "--target-csa-layers",
            "10",
            "12",
            "--topp",
            "0.5",
            "--min-layers",
            "2",
            "--batch-size",
            "2",
            "--concurrency",
            "2",
            "--no-progress",
            "--flush-timeout",
            "5",
        ]
    )
    assert rc == 0
    passes = [b["custom_params"]["flashmemory_dump"] for b in StandIn.bodies]
    assert sorted(p["pass"] for p in passes) == [1, 1, 1, 2, 2, 2]
    assert all(p["topp"] == 0.5 and p["min_layers"] == 2 and p["target_csa_layers"] == [10, 12] for p in passes)
    assert all(p["output_dir"].startswith(str(out.resolve())) for p in passes)
    p2 = [b for b in StandIn.bodies if b["custom_params"]["flashmemory_dump"]["pass"] == 2]
    assert all(b["max_tokens"] == 2 and b["messages"][-1]["role"] == "assistant" for b in p2)
    assert {b["messages"][-1]["content"] for b in p2} == {"response 0", "response 1", "response 2"}
    docs = [load_doc(p) for p in list_docs(out)]
    assert [d.doc_index for d in docs] == [0, 1, 2]
    assert [d.rid for d in docs] == [f"tiny_chat.jsonl:{i}" for i in range(3)]
    for d in docs:
        assert d.target_layers == [10, 12] and all((c == 7).all() for c in d.compk.values())  # pass-2 keys merged
        assert d.labels.to_rows() == make_doc(d.doc_index).labels.to_rows()
    assert [m["compk_shapes"]["10"][0] for m in read_metadata(out)] == [d.n_chunks for d in docs]
    assert not any((out / ".staging").rglob("*.safetensors"))
    assert all(p["store_topk"] == ("cycle" if p["pass"] == 1 else "none") and p["topk_interval"] == 64 for p in passes)
    assert all(d.native_topk_steps.tolist() == [0] and sorted(d.native_topk) == [0, 1, 2, 3] for d in docs)


@pytest.mark.parametrize("mode,interval,want", [("all", 64, list(range(9))), ("cycle", 4, [0, 4, 8]), ("none", 64, [])])
def test_store_topk_reaches_the_server_and_the_committed_doc(server, tmp_path, capfd, mode, interval, want):
    out = tmp_path / "out"
    rc = main(
        [
            "--backend",
            "sglang",
            "--url",
            server,
            "--input",
            EX,
            "--output-dir",
            str(out),
            "--n-samples",
            "2",
            "--target-csa-layers",
            "10",
            "--no-progress",
            "--flush-timeout",
            "5",
            "--store-topk",
            mode,
            "--topk-interval",
            str(interval),
        ]
    )
    assert rc == 0 and "top-k" not in capfd.readouterr().err  # the old "does not store native top-k" note is gone
    blocks = [b["custom_params"]["flashmemory_dump"] for b in StandIn.bodies]
    assert all(b["version"] == 2 and b["topk_interval"] == interval for b in blocks)
    assert sorted((b["pass"], b["store_topk"]) for b in blocks) == [(1, mode)] * 2 + [(2, "none")] * 2
    for d in [load_doc(p) for p in list_docs(out)]:  # make_doc: T = 9 decode steps
        assert d.native_topk_steps.tolist() == want
        assert sorted(d.native_topk) == ([0, 1, 2, 3] if want else [])
        assert all(i.shape == (len(want), 6) for i, _ in d.native_topk.values())


def test_a_server_that_drops_the_topk_fails_the_item_clearly(server, tmp_path):
    import io

    from flashmemory.dump.backend import DumpConfig
    from flashmemory.dump.client import run_dump
    from flashmemory.dump.sglang_backend import SGLangBackend

    StandIn.old_server = True
    out, log = tmp_path / "out", io.StringIO()
    rep = run_dump(
        SGLangBackend(server, out, flush_timeout=5),
        EX,
        out,
        DumpConfig(target_layers=(10,), store_topk="cycle"),
        n_samples=1,
        progress=False,
        log=log,
    )
    assert not rep.committed and len(rep.failed) == 1 and not list_docs(out)
    assert "native top-k at steps []" in rep.failed[0] and "asks for [0]" in rep.failed[0]


def test_unreachable_server(tmp_path, capsys):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    rc = main(
        [
            "--backend",
            "sglang",
            "--url",
            f"http://127.0.0.1:{port}/v1",
            "--input",
            EX,
            "--output-dir",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert rc == 2 and "cannot reach the sglang server" in capsys.readouterr().err


def test_protocol_validation():
    with pytest.raises(DumpProtocolError, match="absolute"):
        DumpRequest(pass_=1, doc_index=0, output_dir="rel")
    with pytest.raises(DumpProtocolError, match="missing"):
        DumpRequest.from_custom_params({"flashmemory_dump": {"pass": 1}})
    assert DumpRequest.from_custom_params({"other": 1}) is None
    r = DumpRequest(pass_=2, doc_index=5, output_dir="/s")
    assert DumpRequest.from_custom_params(r.to_custom_params()) == r
    assert str(r.doc_path()) == "/s/pass2/doc_00005.safetensors"
    r = DumpRequest(pass_=1, doc_index=0, output_dir="/s", store_topk="all", topk_interval=7)
    assert r.to_custom_params()["flashmemory_dump"]["version"] == 2
    assert DumpRequest.from_custom_params(r.to_custom_params()) == r


def test_protocol_old_blocks_parse_with_topk_defaults():
    """A version-1 block (no store_topk / topk_interval) and a block without a version still parse."""
    old = {
        "version": 1,
        "pass": 1,
        "doc_index": 3,
        "output_dir": "/s",
        "topp": 0.5,
        "min_layers": 2,
        "target_csa_layers": [10, 12],
        "n_logit_tokens": 3,
    }
    r = DumpRequest.from_custom_params({"flashmemory_dump": old})
    assert (r.store_topk, r.topk_interval, r.version, r.topp, r.target_csa_layers) == ("cycle", 64, 1, 0.5, (10, 12))
    r = DumpRequest.from_custom_params({"flashmemory_dump": {"pass": 2, "doc_index": 0, "output_dir": "/s"}})
    assert (r.store_topk, r.topk_interval, r.version) == ("cycle", 64, 2)


@pytest.mark.parametrize(
    "field,value,msg",
    [
        ("store_topk", "x", r"store_topk='x': expected one of none, cycle, all"),
        ("store_topk", None, r"store_topk=None"),
        ("store_topk", 1, r"store_topk=1"),
        ("topk_interval", 0, r"topk_interval=0: must be an integer >= 1"),
        ("topk_interval", -3, r"topk_interval=-3"),
        ("topk_interval", "often", r"topk_interval='often': bad field value"),
        ("topk_interval", 1.5, r"topk_interval=1.5: bad field value"),
        ("topk_interval", True, r"topk_interval=True: bad field value"),
        ("version", 3, r"version=3: this side speaks version\(s\) 1, 2"),
    ],
)
def test_protocol_rejects_bad_topk_fields(field, value, msg):
    block = {"pass": 1, "doc_index": 0, "output_dir": "/s", field: value}
    with pytest.raises(DumpProtocolError, match=msg):
        DumpRequest.from_custom_params({"flashmemory_dump": block})
    if field != "version":
        with pytest.raises(DumpProtocolError, match=field):
            DumpRequest(pass_=1, doc_index=0, output_dir="/s", **{field: value})


def test_protocol_checks_the_version_before_fields_it_may_not_know():
    block = {"version": 3, "pass": 1, "doc_index": 0, "output_dir": "/s", "store_topk": "some-new-mode"}
    with pytest.raises(DumpProtocolError, match="version=3.*update flashmemory"):
        DumpRequest.from_custom_params({"flashmemory_dump": block})
