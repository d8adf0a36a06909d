"""`eval.live.stack`: the OpenAI-client request against a stand-in router (what it sends, what it reads back) and
the shared live lock (a second holder waits until the first lets go)."""

from __future__ import annotations

import fcntl
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flashmemory.eval.live.stack import LiveLock, complete


class _Router(BaseHTTPRequestHandler):
    seen: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Router.seen.append((self.path, body))
        if isinstance(body["prompt"], list):  # as sglang-router 0.3.2: token-id prompts are refused
            self.send_response(422)
            self.end_headers()
            return
        choice = {"index": 0, "text": "a b", "finish_reason": "length", "token_ids": [5, 6, 7]}
        if body.get("return_token_ids"):
            choice["prompt_token_ids"] = [1, 2]
        out = {"id": "x", "object": "text_completion", "created": 0, "model": "default", "choices": [choice]}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def router():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Router)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    _Router.seen = []
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_complete_sends_a_greedy_text_prompt_and_reads_both_id_lists(router, monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    c = complete(router, "<bos> <|user|> hello", 3)
    assert (c.prompt_ids, c.output_ids, c.text) == ([1, 2], [5, 6, 7], "a b")
    (path, body) = _Router.seen[0]
    assert path == "/v1/completions" and body["prompt"] == "<bos> <|user|> hello" and body["max_tokens"] == 3
    assert body["temperature"] == 0.0 and body["ignore_eos"] is True and body["return_token_ids"] is True
    assert body["skip_special_tokens"] is False


def test_live_lock_waits_for_the_holder(tmp_path):
    path = tmp_path / "live.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another live user (e.g. `flock /tmp/fm-live.lock ...`) holds it
    lines, got = [], threading.Event()

    def take():
        with LiveLock(path, lines.append):
            got.set()

    t = threading.Thread(target=take)
    t.start()
    while not lines:  # it says it waits, and does not get the lock while the holder keeps it
        t.join(0.05)
    assert "waiting for the live-server lock" in lines[0] and not got.is_set()
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    t.join(30)
    assert got.is_set()
