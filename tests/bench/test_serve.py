"""bench serve's arithmetic: prompt lengths and the decode-rate summary of concurrent streamed requests."""

import math
import threading

from flashmemory.bench.serve import contexts, summarize
from flashmemory.serve.client import StreamResult


def test_contexts_spread_over_the_range():
    assert contexts(1024, 4096, 4) == [1024, 2048, 3072, 4096]
    assert contexts(512, 512, 3) == [512, 512, 512] and contexts(100, 200, 1) == [200]


def test_summary_counts_tokens_after_the_first_over_the_shared_window():
    a = StreamResult(sent=0.0, token_times=[1.0, 2.0, 3.0], n_tokens=3)  # 2 decoded, ITL 1 s
    b = StreamResult(sent=0.0, token_times=[2.0, 2.5, 3.0, 5.0], n_tokens=4)  # 3 decoded, ITL 1 s
    s = summarize([a, b])
    assert math.isclose(s["decode_tok_s"], 5 / 4.0)  # window 1.0 .. 5.0
    assert math.isclose(s["itl_ms"], 1000.0) and math.isclose(s["ttft_s"], 1.5) and s["wall_s"] == 5.0
    assert math.isclose(s["steady_tok_s"], 3 / 1.0) and s["steady_window_s"] == 1.0  # both decoding: (2.0, 3.0]
    late = StreamResult(sent=0.0, token_times=[4.0, 6.0], n_tokens=2)  # starts after `a` ended
    assert math.isnan(summarize([a, late])["steady_tok_s"])


def test_concurrent_requests_report_progress_as_they_finish(monkeypatch):
    """bench serve's arms run for minutes: each finished request prints its line when it finishes, while the others
    still run. The last request here returns only once the other two lines are out, so lines printed after the
    join of all requests leave it waiting (it gives up after 30 s and the test fails)."""
    import flashmemory.bench.serve as bs

    lines: list[str] = []
    two_reported = threading.Event()

    def record(*args, **kwargs) -> None:
        lines.append(" ".join(map(str, args)))
        if sum("finished" in ln for ln in lines) >= 2:
            two_reported.set()

    waited: list[bool] = []

    def stream(url, ids, n, stop):
        if ids[0] == 3:
            waited.append(two_reported.wait(timeout=30))
        return StreamResult(sent=0.0, token_times=[1.0, 2.0], n_tokens=2)

    monkeypatch.setattr(bs, "print", record, raising=False)
    monkeypatch.setattr(bs, "generate_stream", stream)
    out = bs._concurrent("http://x", [[1] * 5, [2] * 7, [3] * 9], 4, 2)
    assert len(out) == 3 and waited == [True]
    finished = [ln for ln in lines if "finished" in ln]
    assert len(finished) == 3 and finished[-1] == "  request 2 (9 tokens) finished: 3/3"
    assert any("(7 tokens)" in ln for ln in finished)
