"""The sglang client against a local stand-in server that speaks the dump protocol."""

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from flashmemory.dump import list_docs, load_doc, read_metadata
from flashmemory.dump.cli import main
from flashmemory.dump.protocol import DumpProtocolError, DumpRequest
from flashmemory.dump.writer import save_doc_file
from .synth import make_doc

EX = "data_generation/example_data/tiny_chat.jsonl"


class StandIn(BaseHTTPRequestHandler):
    bodies: list = []

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
        self._send({"data": [{"id": "stand-in"}]} if self.path == "/v1/models" else {}, 200 if self.path == "/v1/models" else 404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StandIn.bodies.append(body)
        req = DumpRequest.from_custom_params(body.get("custom_params"))
        req.doc_path().parent.mkdir(parents=True, exist_ok=True)
        if req.pass_ == 1:
            save_doc_file(req.doc_path(), make_doc(req.doc_index, layers=req.target_csa_layers))
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
    srv = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


def test_two_pass_dump_via_stand_in(server, tmp_path):
    out = tmp_path / "out"
    rc = main(["--backend", "sglang", "--url", server, "--input", EX, "--output-dir", str(out), "--n-samples", "3",
               "--target-csa-layers", "10", "12", "--topp", "0.5", "--min-layers", "2", "--batch-size", "2",
               "--concurrency", "2", "--no-progress", "--flush-timeout", "5"])
    assert rc == 0
    passes = [b["custom_params"]["flashmemory_dump"] for b in StandIn.bodies]
    assert sorted(p["pass"] for p in passes) == [1, 1, 1, 2, 2, 2]
    assert all(p["topp"] == 0.5 and p["min_layers"] == 2 and p["target_csa_layers"] == [10, 12] for p in passes)
    assert all(p["output_dir"].startswith(str(out.resolve())) for p in passes)
    p2 = [b for b in StandIn.bodies if b["custom_params"]["flashmemory_dump"]["pass"] == 2]
    assert all(b["max_tokens"] == 2 and b["messages"][-1]["role"] == "assistant" for b in p2)
    assert {b["messages"][-1]["content"] for b in p2} == {"response 0", "response 1", "response 2"}
    docs = [load_doc(p) for p in list_docs(out)]
    assert [d.doc_index for d in docs] == [0, 1, 2] and [d.rid for d in docs] == [f"tiny_chat.jsonl:{i}" for i in range(3)]
    for d in docs:
        assert d.target_layers == [10, 12] and all((c == 7).all() for c in d.compk.values())  # pass-2 keys merged
        assert d.labels.to_rows() == make_doc(d.doc_index).labels.to_rows()
    assert [m["compk_shapes"]["10"][0] for m in read_metadata(out)] == [d.n_chunks for d in docs]
    assert not any((out / ".staging").rglob("*.safetensors"))


def test_unreachable_server(tmp_path, capsys):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    rc = main(["--backend", "sglang", "--url", f"http://127.0.0.1:{port}/v1", "--input", EX,
               "--output-dir", str(tmp_path), "--no-progress"])
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
