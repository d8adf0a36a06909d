"""The /metrics parser keeps the flashmemory_* samples, sums labelled series and drops non-finite values."""

from flashmemory.serve.client import greedy_params, parse_metrics

TEXT = """# HELP flashmemory_recall_bytes_total Bytes copied host -> device by recalls
# TYPE flashmemory_recall_bytes_total counter
flashmemory_recall_bytes_total 73728.0
flashmemory_resident_fraction{pid="12"} 0.125
flashmemory_level1_cycles_total{pid="12"} 3.0
flashmemory_level1_cycles_total{pid="13"} 2.0
flashmemory_level1_cycle_seconds NaN
sglang:num_running_reqs{model_name="x"} 4.0
"""


def test_parse_metrics():
    m = parse_metrics(TEXT)
    assert m == {
        "flashmemory_recall_bytes_total": 73728.0,
        "flashmemory_resident_fraction": 0.125,
        "flashmemory_level1_cycles_total": 5.0,
    }


def test_greedy_params_ignore_eos():
    assert greedy_params(8) == {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def test_generate_stream_stops_when_asked_and_times_every_token():
    """A local SSE /generate sending 1, 3, 4, ... completion tokens: `stop` sees each update and ends the stream."""
    import http.server
    import json
    import threading

    from flashmemory.serve.client import generate_stream

    class Stream(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            try:
                for done in (1, 3, 4, 5, 6, 7, 8):
                    self.wfile.write(f"data: {json.dumps({'meta_info': {'completion_tokens': done}})}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
            except (BrokenPipeError, ConnectionResetError):  # the client stopped early
                pass

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stream)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        full = generate_stream(url, [1, 2], 8)
        assert full.n_tokens == 8 and len(full.token_times) == 8
        seen = []
        part = generate_stream(url, [1, 2], 8, stop=lambda t: seen.append(len(t)) or len(t) >= 4)
        assert part.n_tokens == 4 and seen == [1, 3, 4]
    finally:
        srv.shutdown()
