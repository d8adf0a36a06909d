"""The FlashMemory guard on CPU with the real Path-P adapter on a fake DSv4 pool: a failure costs
one request (the others' resident pages are those of a fault-free run), anything else stops the server with one
line, and the gauges say idle once nothing runs."""

import types

import pytest
import torch

from flashmemory.env import EnvError, fault_inject
from flashmemory.offload.mirror import OffloadCapacityError
from flashmemory.sglang.decode import guard as guard_mod
from flashmemory.sglang.decode import hooks
from flashmemory.sglang.decode.adapter_factory import build
from flashmemory.sglang.decode.guard import Guard, RequestFailure
from flashmemory.sglang.decode.runtime import RUNTIME
from tests.sglang.decode.test_copy_adapter import PAGE, env, fake_pool

pytestmark = pytest.mark.sglang
prom = pytest.importorskip("prometheus_client")
PAGES = {"a": [5, 2], "bad-1": [9, 7]}  # pool pages of each request, logical order
SEQ = PAGE + 40  # tokens: two c4 pages of history


class _Mode:
    def __init__(self, decode: bool = True):
        self.decode = decode

    def is_decode(self) -> bool:
        return self.decode

    def is_idle(self) -> bool:
        return False


class _Req:
    def __init__(self, rid: str):
        self.rid, self.to_finish = rid, None

    def finished(self) -> bool:
        return False


class _Batch:
    def __init__(self, n: int):
        self.n = n

    def is_empty(self) -> bool:
        return self.n == 0


@pytest.fixture
def served(monkeypatch):
    """RUNTIME with a copy-mode adapter over a fake pool, a fresh guard (its stop recorded, not run) and metrics in a
    private registry. Returns a namespace with the model runner, a batch maker and the stops."""
    from flashmemory.sglang.metrics.exporter import MetricsExporter
    from flashmemory.sglang.metrics.prometheus import FlashMemoryMetrics, failure_counter

    pool, e = fake_pool(), env()
    adapter = build(pool, e)
    reg = prom.CollectorRegistry()
    g = Guard()
    stops: list[str] = []
    g.stop = stops.append
    g.hook_names = hooks.HOOK_NAMES
    g.precheck = hooks._admission_precheck
    g.counter = failure_counter(registry=reg)
    monkeypatch.setattr(RUNTIME, "guard", g)
    for name, value in dict(
        env=e,
        engine=adapter,
        pool=pool,
        features=("level2", "path_p"),
        bufs=None,
        sideband=None,
        metrics=FlashMemoryMetrics.create(registry=reg),
        exporter=MetricsExporter(RUNTIME.export),  # not started: the test flushes it
        steps=0,
        diag_path="",
    ).items():
        monkeypatch.setattr(RUNTIME, name, value)
    r2t = torch.full((2, 4 * PAGE), -1, dtype=torch.int64)
    for i, pages in enumerate(PAGES.values()):
        r2t[i, : len(pages) * PAGE] = torch.tensor([p * PAGE + j for p in pages for j in range(PAGE)])
    mr = types.SimpleNamespace(is_draft_worker=False, req_to_token_pool=types.SimpleNamespace(req_to_token=r2t))

    def batch(rids, step=0):
        idx = [list(PAGES).index(r) for r in rids]
        return types.SimpleNamespace(
            forward_mode=_Mode(),
            rids=list(rids),
            req_pool_indices=torch.tensor(idx),
            seq_lens=torch.full((len(rids),), SEQ + 1 + step, dtype=torch.int64),
        )

    yield types.SimpleNamespace(adapter=adapter, mr=mr, batch=batch, guard=g, stops=stops, reg=reg)
    adapter.close()


def _value(reg, name, **labels):
    """The sample `name` of this (non-server) process's series: its rank labels are dp_rank 0, attn_tp_rank 0."""
    v = reg.get_sample_value(name, {"dp_rank": "0", "attn_tp_rank": "0", **labels})
    return None if v is None else float(v)


def _step(s, rids, step=0):
    fb = s.batch(rids, step)
    hooks.before_forward(s.mr, fb)
    hooks.after_forward(None, s.mr, fb)
    return fb


def test_an_injected_fault_fails_that_request_alone(served):
    s = served
    clean = Guard()  # the fault-free run's resident pages of "a", for comparison
    s.guard.configure({"FLASHMEMORY_FAULT_INJECT": "hook=before_forward,rid=^bad"})
    _step(s, ["a", "bad-1"])
    assert set(s.guard.failed) == {"bad-1"} and s.stops == []
    assert set(s.adapter.rows) == {"a"}  # the failed request holds no engine row
    assert RUNTIME.bufs.sel_pages[1].eq(-1).all()  # and no resident page: its attention reads nothing
    assert _value(s.reg, "flashmemory_request_failures_total", hook="before_forward") == 1.0
    # sglang processes the batch's result: the failed request finishes with an abort naming the hook, status 500
    reqs = [_Req("a"), _Req("bad-1")]
    hooks.before_process_batch_result(types.SimpleNamespace(), types.SimpleNamespace(reqs=reqs), None)
    assert reqs[0].to_finish is None
    msg = reqs[1].to_finish.to_json()
    assert msg["type"] == "abort" and msg["status_code"] == 500 and "before_forward" in msg["message"]
    # overlap: the next forward was launched before the abort landed; the request is not admitted again
    _step(s, ["a", "bad-1"], step=1)
    assert set(s.adapter.rows) == {"a"}
    assert _value(s.reg, "flashmemory_request_failures_total", hook="before_forward") == 1.0
    # then it is gone from the batch; the guard forgets it, and a new request is served
    _step(s, ["a"], step=2)
    assert s.guard.failed == {}
    pages_a = RUNTIME.bufs.sel_pages[0].clone()
    # fault-free: the same steps with both requests served give "a" the same resident pages
    s.adapter.begin_step([], torch.zeros((0, 1), dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    RUNTIME.guard = clean
    clean.configured = True
    for step, rids in enumerate((["a", "bad-1"], ["a", "bad-1"], ["a"])):
        _step(s, rids, step)
    assert torch.equal(RUNTIME.bufs.sel_pages[0], pages_a)


def test_a_full_mirror_at_admission_fails_that_request_alone(served):
    """The guard's precheck asks the adapter before `before_forward`'s body runs: a new request whose history the
    host mirror cannot hold fails alone (HTTP 500 naming the hook and the reason), the other keeps decoding, and
    once pages are free again a new request is admitted."""
    s = served
    s.guard.configured = True
    _step(s, ["a"])
    mirror = s.adapter.engine.mirror
    held = mirror.alloc(mirror.free_pages - 1)  # one page left; "bad-1" needs two
    _step(s, ["a", "bad-1"], step=1)
    assert s.stops == [] and set(s.guard.failed) == {"bad-1"} and set(s.adapter.rows) == {"a"}
    assert "host mirror full" in s.guard.failed["bad-1"].reason
    assert _value(s.reg, "flashmemory_request_failures_total", hook="before_forward") == 1.0
    reqs = [_Req("a"), _Req("bad-1")]
    hooks.before_process_batch_result(types.SimpleNamespace(), types.SimpleNamespace(reqs=reqs), None)
    assert reqs[0].to_finish is None and "host mirror full" in reqs[1].to_finish.to_json()["message"]
    _step(s, ["a"], step=2)
    mirror.free(held)
    saved = dict(PAGES)
    PAGES.clear()
    PAGES.update({"a": saved["a"], "b-2": saved["bad-1"]})  # a new request in the same pool slot
    try:
        _step(s, ["a", "b-2"], step=3)
    finally:
        PAGES.clear()
        PAGES.update(saved)
    assert set(s.adapter.rows) == {"a", "b-2"} and s.stops == []


def test_an_unforeseen_capacity_error_inside_begin_step_stops_the_server(served, monkeypatch):
    """A capacity error inside `begin_step` that the precheck did not foresee leaves rows registered but not
    admitted (the adapter registers them before the core admits them in one sync_batch), so it is not
    request-local (one line, the server stops)."""
    s = served
    s.guard.configured = True
    admission = s.adapter._admission

    def full(row, rid, pages, n):
        if rid == "bad-1":
            raise OffloadCapacityError("host mirror: need 2 pages, 0 of 24 free")
        return admission(row, rid, pages, n)

    monkeypatch.setattr(s.adapter, "_admission", full)
    with pytest.raises(SystemExit):
        hooks.before_forward(s.mr, s.batch(["a", "bad-1"]))
    assert s.guard.failed == {} and len(s.stops) == 1
    assert "before_forward failed (OffloadCapacityError: host mirror" in s.stops[0] and "state in doubt" in s.stops[0]


def test_anything_else_stops_the_server_with_one_line(served, monkeypatch, caplog):
    s = served
    s.guard.configured = True
    monkeypatch.setattr(s.adapter, "begin_step", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(SystemExit):
        hooks.before_forward(s.mr, s.batch(["a"]))
    assert s.stops == [
        "FlashMemory: before_forward failed (RuntimeError: boom); engine state in doubt, stopping the server"
    ]
    assert s.stops[0] in caplog.text
    with pytest.raises(SystemExit):  # nothing runs any more in this process
        hooks.after_forward(None, s.mr, s.batch(["a"]))
    # a request-local error escaping the body of a per-layer hook is not request-local there: the forward is half done
    g = Guard(stop=s.stops.append, configured=True)
    with pytest.raises(SystemExit):
        g.run("around_attention", lambda: (_ for _ in ()).throw(RequestFailure("a", "x", "y")), (), {})


def test_a_level1_failure_naming_its_request_skips_the_step(served, monkeypatch):
    s = served
    s.guard.configured = True

    def worker_failed(fb):
        try:
            raise RequestFailure("bad-1", "level1", "non-finite retriever score")
        except RequestFailure as e:
            raise RuntimeError("Level-1 worker failed") from e

    hooks.before_forward(s.mr, s.batch(["a", "bad-1"]))
    monkeypatch.setattr(RUNTIME, "after_decode_forward", worker_failed)
    assert hooks.after_forward(None, s.mr, s.batch(["a", "bad-1"])) is None
    assert set(s.guard.failed) == {"bad-1"} and s.stops == []
    assert "non-finite" in s.guard.failed["bad-1"].reason
    hooks.before_forward(s.mr, s.batch(["a", "bad-1"], 1))
    assert set(s.adapter.rows) == {"a"}  # released at the next step


def test_a_non_finite_retriever_score_fails_its_request(served):
    s = served
    s.guard.configured = True
    s.guard.watch_scores(s.adapter)
    once = s.adapter.l1.scorer
    s.guard.watch_scores(s.adapter)  # idempotent: wrapped once
    assert s.adapter.l1.scorer is once and once.flashmemory_checked
    bad_row = {}

    def nan_for_bad(row, n_hist, hidden, position):
        out = torch.ones(n_hist)
        if row == bad_row.get("row"):
            out[3] = float("nan")
        return out

    s.adapter.l1.scorer = nan_for_bad
    s.adapter.l1.scorer.flashmemory_checked = False
    s.guard.watch_scores(s.adapter)
    hooks.before_forward(s.mr, s.batch(["a", "bad-1"]))
    bad_row["row"] = s.adapter.rows["bad-1"]
    assert hooks.after_forward(None, s.mr, s.batch(["a", "bad-1"])) is None
    assert set(s.guard.failed) == {"bad-1"} and s.stops == []
    assert "non-finite retriever score for 1 of" in s.guard.failed["bad-1"].reason
    assert s.guard.failed["bad-1"].hook == "after_forward"
    hooks.before_forward(s.mr, s.batch(["a", "bad-1"], 1))  # its row is released at the next step
    assert set(s.adapter.rows) == {"a"}
    hooks.after_forward(None, s.mr, s.batch(["a", "bad-1"], 1))
    assert set(s.guard.failed) == {"bad-1"} and s.stops == []  # "a" keeps its cycles


def test_gauges_say_idle_once_nothing_runs(served):
    s = served
    s.guard.configured = True
    _step(s, ["a", "bad-1"])
    assert RUNTIME.exporter.flush()  # the decode step only marked the export due
    val = lambda k: _value(s.reg, "flashmemory_" + k, dp_rank="0", attn_tp_rank="0")  # noqa: E731  # one process: rank 0
    total = val("reserve_blocks")
    assert val("live_requests") == 2 and val("free_reserve_blocks") < total and val("host_mirror_bytes_in_use") > 0
    assert val("resident_fraction") > 0 and val("reserve_used_fraction") > 0
    # both finish; sglang goes idle before any further decode forward (the rows were released only there before)
    busy = types.SimpleNamespace(running_batch=_Batch(1), last_batch=None)
    hooks.after_on_idle(None, busy)
    assert val("live_requests") == 2 and set(s.adapter.rows) == {"a", "bad-1"}  # still running: nothing released
    idle = types.SimpleNamespace(running_batch=_Batch(0), last_batch=None, result_queue=[])
    hooks.after_on_idle(None, idle)
    assert s.adapter.rows == {}
    assert (val("live_requests"), val("free_reserve_blocks"), val("host_mirror_bytes_in_use")) == (0, total, 0)
    assert (val("resident_fraction"), val("reserve_used_fraction")) == (0, 0)


def test_fault_inject_variable_is_checked():
    assert fault_inject({}) is None
    spec = fault_inject({"FLASHMEMORY_FAULT_INJECT": "hook=before_forward, rid=^bad-"}, hooks=("before_forward",))
    assert (spec.hook, spec.rid) == ("before_forward", "^bad-")
    for bad, why in (
        ("rid=x", "needs both"),
        ("hook=nope,rid=x", "unknown hook"),
        ("hook=before_forward,rid=(", "regular"),
        ("hook=before_forward,rid=x,rid=y", "bad part"),
        ("before_forward", "bad part"),
    ):
        with pytest.raises(EnvError, match=f"FLASHMEMORY_FAULT_INJECT=.*{why}"):
            fault_inject({"FLASHMEMORY_FAULT_INJECT": bad}, hooks=("before_forward",))
    # a bad value reaches the server at its first guarded hook: one line naming the variable, and it stops
    stops: list[str] = []
    g = Guard(stop=stops.append, hook_names=("before_forward",))
    g.configure = lambda env=None: Guard.configure(g, {"FLASHMEMORY_FAULT_INJECT": "hook=nope,rid=x"})
    with pytest.raises(SystemExit):
        g.run("before_forward", lambda: None, (), {})
    assert len(stops) == 1 and "FLASHMEMORY_FAULT_INJECT" in stops[0] and "unknown hook 'nope'" in stops[0]


def test_the_default_stop_signals_no_parent_outside_a_server(monkeypatch):
    """Outside an sglang server (no server args: tests, tools) the stop is the SystemExit alone: the parent is a shell
    or a test runner, and SIGQUIT would take it down."""
    psutil = pytest.importorskip("psutil")
    sent: list[int] = []

    class Launcher:  # the server's parent; a stand-in, since this runner's own parent may be init (pid 1)
        pid = 4242

        def send_signal(self, sig):
            sent.append(sig)

    monkeypatch.setattr(psutil.Process, "parent", lambda self: Launcher())
    with pytest.raises(SystemExit, match="state in doubt"):
        guard_mod._stop_server("FlashMemory: x failed (E); engine state in doubt, stopping the server")
    assert sent == []
    monkeypatch.setattr("flashmemory.sglang.decode.guard.server_args", lambda: object())  # inside a server
    with pytest.raises(SystemExit):
        guard_mod._stop_server("stop")
    assert len(sent) == 1
