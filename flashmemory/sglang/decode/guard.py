"""One guard around every FlashMemory hook: a failure costs one request, never the server.

Every hook in `hooks.py` runs inside `RUNTIME.guard.run` (the `guarded` decorator). An exception is classified:

request-local (`request_local`): a `RequestFailure(rid, hook, reason)` (the test-only fault injector raises one;
    so does the Level-1 scorer wrapper for a row with non-finite scores), or anything whose cause chain holds one
    (the Level-1 worker's error is re-raised on the decode thread with the worker's exception as its cause). The
    request is recorded as failed: one log line names it and the hook,
    `flashmemory_request_failures_total{hook=...}` counts it, and before sglang processes the batch's result
    (`before_process_batch_result`) its `to_finish` is set to FINISH_ABORT with a message naming the hook, status
    500: sglang's own abort path finishes it, frees its KV and sends the client an HTTP error (a stream ends with
    an abort finish reason). From then on every `before_forward` hands the runtime the batch without it (its rid
    renamed and its length 0, so the adapter finishes its row, pages and regions and never admits it again).
anything else: the engine's state is in doubt. One line `FlashMemory: <hook> failed (<error>); engine state in
    doubt, stopping the server` is logged, the parent server process gets SIGQUIT (what sglang's scheduler sends
    when it dies: the launcher stops every process) and the scheduler exits with SystemExit. No further token is
    served by FlashMemory in this process (`run` refuses to run any hook once stopping).

The forward in which a request fails stays correct for the others:
- a failure raised before a hook's body ran (the injector checks at entry) leaves nothing half done, so the body
  then runs for the whole batch: the faulted row is computed like any other and its token is discarded because
  the request is aborted before its result is emitted;
- every `before_forward` hands the runtime the batch without the failed requests, so the failed row gets engine
  row -1 (no resident page: its attention reads nothing of the reserve, which only changes its own token);
- `after_forward` (Level 1) is not retried: that step's Level-1 call is skipped (and a worker error means the
  cycle it was running was discarded), so the other rows keep the pages they hold until their next cycle (at full
  budget nothing changes; at a small budget their residency is updated a cycle later); the idle hook
  (`after_on_idle`) likewise tries again at the next idle poll;
- requests the adapter cannot admit (no free engine row, host mirror full) are found before `before_forward`'s
  body runs (`precheck` -> `OffloadAdapter.admission_refusals`) and failed there like an injected fault: the body
  never sees them;
- a request-local failure escaping the body of any other hook (the forward is half done) is treated as engine
  state in doubt: nothing can show that the other rows' tensors are whole. That includes a capacity error inside
  `begin_step` that the precheck did not foresee (a growing history crossing into a page the mirror lacks): the
  adapter registers rows before the core admits them in one `sync_batch`.
Under CUDA-graph replay the per-layer hooks do not run at all, so only the eager hooks can fail there.
Tensor parallelism: every rank runs its own guard over the same batches. A request that failed on one rank only
(a fault injected on that rank, a rank-local error) must fail on all of them, or their schedulers would run
different batches and the next collective would hang. So before each batch's result is processed every rank
shares the failures it recorded since the last batch (`exchange`: one all-reduce of a count over the cpu group of
the ranks that run the batch, sglang's TP group or, under attention data parallelism, its attention-TP group; then
an all-gather of the (rid, hook, reason) rows only when some rank has any), and every rank aborts the union in that
same call.
Non-finite retriever scores: `watch_scores` wraps the adapter's Level-1 scorer so that a row whose scores are not
all finite raises `RequestFailure` naming its request (the cycle's job is dropped, its error reaches `after_forward`
as the cause of the worker's error). Other Level-1 or recall errors name no request and stop the server.
"""

from __future__ import annotations

import functools
import logging
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flashmemory.env import EnvError, fault_inject
from flashmemory.sglang.decode.guard_tp import tp_exchange
from flashmemory.sglang.decode.server import server_args

if TYPE_CHECKING:  # type only: the guard is imported before any adapter exists
    from flashmemory.sglang.decode.offload_adapter import OffloadAdapter

logger = logging.getLogger(f"sglang.{__name__}")  # under "sglang": its log handler prints it
FAILED_PREFIX = "\x00flashmemory-failed:"  # renamed rid of a failed request inside the runtime's view
FIRST_HOOK = "before_forward"  # the first hook of every forward: it reads the batch's rids
SKIP_HOOKS = frozenset({"after_forward", "after_on_idle"})  # hooks skipped for this call after a request-local failure


class RequestFailure(RuntimeError):
    """Request `rid` cannot be served any further; `hook` is where that was found, `reason` why."""

    def __init__(self, rid: str, hook: str, reason: str):
        super().__init__(f"request {rid!r} failed in {hook}: {reason}")
        self.rid, self.hook, self.reason = rid, hook, reason


@dataclass
class _Failed:
    hook: str
    reason: str
    aborted: bool = False  # sglang's to_finish was set


@dataclass
class _BatchView:
    """What `Runtime.before_forward` reads of a forward batch, failed requests removed: the rid renamed (never
    matches a live request) and the length 0 (no c4 chunk: never admitted). Other attributes come from `batch`."""

    batch: Any
    rids: list[str]
    seq_lens: Any

    @property
    def seq_lens_cpu(self) -> Any:
        """sglang's host copy of the lengths with the failed rows at 0 as well (None where the batch has none)."""
        cpu = getattr(self.batch, "seq_lens_cpu", None)
        if cpu is None:
            return None
        cpu = cpu.clone()
        for i, r in enumerate(self.rids[: cpu.shape[0]]):
            if r.startswith(FAILED_PREFIX):
                cpu[i] = 0
        return cpu

    def __getattr__(self, name: str) -> Any:
        return getattr(self.batch, name)


def _stop_server(message: str) -> None:
    """sglang's own stop when a scheduler dies: SIGQUIT to the parent (the launcher stops every process), then
    leave the event loop with SystemExit (not an Exception: sglang's loop would log a traceback for those). Only
    inside an sglang server (its server args are set): elsewhere (tests, tools) the parent is a shell or a test
    runner, and the SystemExit alone stops the caller."""
    try:
        import psutil

        parent = psutil.Process().parent() if server_args() is not None else None
        if parent is not None and parent.pid != 1:
            parent.send_signal(signal.SIGQUIT)
    except Exception as e:  # noqa: BLE001 - stopping anyway
        logger.error("FlashMemory: could not signal the server process (%s)", e)
    raise SystemExit(message)


@dataclass
class Guard:
    """Process-wide guard state (one per scheduler process: `runtime.RUNTIME.guard`)."""

    failed: dict[str, _Failed] = field(default_factory=dict)  # rid -> failure, until sglang has dropped it
    batch_rids: list[str] = field(default_factory=list)  # rids of the forward in progress
    inject: tuple[str, re.Pattern] | None = None  # (hook, rid pattern) from FLASHMEMORY_FAULT_INJECT
    stopping: bool = False
    hook_names: tuple[str, ...] = ()  # what FLASHMEMORY_FAULT_INJECT may name (every `guarded` hook)
    configured: bool = False  # `configure` ran (first guarded call)
    stop: Callable[[str], None] = _stop_server
    counter: Any = None  # flashmemory_request_failures_total{hook, dp_rank, attn_tp_rank}
    idle_published: bool = False
    # (args, kwargs) of the first hook -> [(rid, reason)]: requests to fail before the body runs (the adapter's
    # admission check: no free row, host mirror full), so nothing of them is half done when the body starts.
    precheck: Callable[[tuple, dict], list[tuple[str, str]]] | None = None
    # [(rid, hook, reason)] recorded here -> [(rank, rid, hook, reason)] of every TP rank; None on one rank.
    exchange: Callable[[list[tuple[str, str, str]]], list[tuple[int, str, str, str]]] | None = None
    rank: int = 0  # this process's TP rank (the injector's rank=)
    unshared: list[tuple[str, str, str]] = field(default_factory=list)  # local failures not exchanged yet

    def configure(self, env: dict[str, str] | None = None) -> None:
        """Read FLASHMEMORY_FAULT_INJECT (test only; an EnvError names the variable) and create the counter.
        Runs at the first guarded hook call of the process (the plugin's registration stays as it is)."""
        self.configured = True
        if self.exchange is None:
            self.exchange, self.rank = tp_exchange()
        spec = fault_inject(env, hooks=self.hook_names)
        on_rank = spec is not None and (spec.rank is None or spec.rank == self.rank)
        self.inject = (spec.hook, re.compile(spec.rid)) if on_rank else None
        if spec is not None:
            logger.warning(
                "FlashMemory: fault injector on (test only): %s fails requests matching %r", spec.hook, spec.rid
            )
        if self.counter is None:
            from flashmemory.sglang.metrics.prometheus import failure_counter

            try:
                self.counter = failure_counter()
            except ValueError as e:  # another guard of this process registered it (tests build several)
                logger.warning("FlashMemory: request-failure counter not exported by this guard (%s)", e)

    # --- running a hook ---------------------------------------------------------------------------
    def run(
        self,
        name: str,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        rids_of: Callable[[tuple, dict], list[str] | None] | None = None,
    ) -> Any:
        """Call hook `fn` under the guard. rids_of(args, kwargs): the request ids of the hook's batch, read only
        where needed (the first hook of a forward, and the hook the injector names): per-layer hooks stay cheap."""
        if self.stopping:
            raise SystemExit("FlashMemory: the server is stopping (engine state in doubt)")
        if not self.configured:
            try:
                self.configure()
            except EnvError as e:  # a bad FLASHMEMORY_FAULT_INJECT: one line naming it, and the server stops
                self.stopping = True
                logger.error("FlashMemory: %s", e)
                self.stop(f"FlashMemory: {e}")
                raise SystemExit(f"FlashMemory: {e}") from None
        rids = None
        if rids_of is not None and (name == FIRST_HOOK or (self.inject is not None and self.inject[0] == name)):
            rids = rids_of(args, kwargs)
            if rids is not None:
                self.batch_rids = rids
        entered = False
        for _ in range(len(self.batch_rids) + 2):  # each retry fails one more request: bounded by the batch
            try:
                if not entered:
                    entered = True
                    self._maybe_inject(name, rids if rids is not None else self.batch_rids)
                    if name == FIRST_HOOK and self.precheck is not None:
                        for rid, reason in self.precheck(args, kwargs):
                            self.fail(rid, name, reason)
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - classified here, re-raised as a stop otherwise
                before_body = isinstance(e, RequestFailure) and getattr(e, "injected", False)
                bad = self.request_local(name, e)
                if bad is None or not (before_body or name in SKIP_HOOKS):
                    self._stop(name, e)
                for rid, reason in bad:
                    self.fail(rid, name, reason)
                if name in SKIP_HOOKS and not before_body:
                    return None
        self._stop(name, RuntimeError("request failures did not settle after a retry per request"))

    def _maybe_inject(self, name: str, rids: list[str]) -> None:
        if self.inject is None or self.inject[0] != name:
            return
        for rid in rids:
            if rid not in self.failed and self.inject[1].search(str(rid)):
                e = RequestFailure(rid, name, "fault injected by FLASHMEMORY_FAULT_INJECT")
                e.injected = True
                raise e

    def request_local(self, name: str, e: BaseException) -> list[tuple[str, str]] | None:
        """(request id, reason) of the failed requests when `e` belongs to them alone, else None (engine state in
        doubt)."""
        seen, cur = 0, e
        while cur is not None and seen < 16:
            if isinstance(cur, RequestFailure):
                return [(cur.rid, cur.reason)]
            cur, seen = cur.__cause__ or cur.__context__, seen + 1
        return None

    def fail(self, rid: str, hook: str, reason: str) -> None:
        """Record request `rid` as failed (once): log, count, abort at the next result processing."""
        if rid in self.failed:
            return
        self.failed[rid] = _Failed(hook, reason)
        self.unshared.append((rid, hook, reason))
        logger.error(
            "FlashMemory: request %s failed in %s (%s); it is aborted, the server keeps serving", rid, hook, reason
        )
        if self.counter is not None:
            from flashmemory.sglang.metrics.prometheus import scheduler_ranks

            self.counter.labels(hook=hook, **scheduler_ranks()).inc()

    def _stop(self, name: str, e: BaseException) -> None:
        self.stopping = True
        msg = f"FlashMemory: {name} failed ({type(e).__name__}: {e}); engine state in doubt, stopping the server"
        logger.error(msg)
        self.stop(msg)
        raise SystemExit(msg)  # a stand-in `stop` that returns still stops the hook

    # --- what the runtime and the scheduler see ------------------------------------------------------
    def without_failed(self, batch: Any) -> Any:
        """`batch` as `Runtime.before_forward` should see it: failed requests renamed and of length 0 (their
        engine rows are finished, never re-admitted). Also forgets failures sglang has already dropped."""
        if not self.failed:
            return batch
        rids = [str(r) for r in (getattr(batch, "rids", None) or [])]
        for rid in [r for r, f in self.failed.items() if f.aborted and r not in rids]:
            del self.failed[rid]
        drop = [i for i, r in enumerate(rids) if r in self.failed]
        if not drop:
            return batch
        seq = batch.seq_lens.clone()
        seq[drop] = 0
        return _BatchView(batch, [FAILED_PREFIX + r if i in drop else r for i, r in enumerate(rids)], seq)

    def abort_failed(self, reqs: list[Any]) -> int:
        """Before sglang processes a batch's result: set FINISH_ABORT on each failed request of it (its client gets
        an HTTP 500 naming the hook). Returns how many were aborted now. Under tensor parallelism every rank calls
        this for every batch: the failures of all ranks are shared first (a collective), so all abort the same."""
        self.share()
        if not self.failed:
            return 0
        from http import HTTPStatus

        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        n = 0
        for req in reqs:
            f = self.failed.get(getattr(req, "rid", None))
            if f is None or f.aborted or req.finished():
                continue
            req.to_finish = FINISH_ABORT(
                f"FlashMemory: request failed in hook {f.hook}: {f.reason}",
                HTTPStatus.INTERNAL_SERVER_ERROR,
                "InternalServerError",
            )
            f.aborted, n = True, n + 1
        return n

    def share(self) -> None:
        """Exchange this rank's new failures with the other TP ranks and record theirs (no-op on one rank)."""
        mine, self.unshared = self.unshared, []
        if self.exchange is None:
            return
        for rank, rid, hook, reason in self.exchange(mine):
            if rank != self.rank and rid not in self.failed:
                self.fail(rid, hook, f"{reason} (on TP rank {rank})")
        self.unshared = []  # what `fail` just recorded came from the others: nothing left to send

    def watch_scores(self, adapter: OffloadAdapter) -> None:
        """Non-finite Level-1 scores for a row raise `RequestFailure(rid, "level1", ...)` instead of steering its
        residency with NaN (through `OffloadAdapter.check_level1_scores`). Idempotent. With the test-only
        FLASHMEMORY_LEVEL1_DELAY the check first sleeps on the rank it names (a late Level-1 worker)."""
        from flashmemory.env import level1_delay

        delay = level1_delay()
        adapter.check_level1_scores(_refuse_non_finite if delay is None else functools.partial(_late, delay))

    def forget_all(self) -> None:
        """Nothing runs any more (the server is idle): every recorded failure is settled."""
        self.failed.clear()
        self.batch_rids = []
        self.unshared = []


def _refuse_non_finite(rid: str, scores: Any) -> None:
    """Level-1 scores [n_hist] of request `rid`: any non-finite value fails that request."""
    import torch

    bad = ~torch.isfinite(scores)
    if bool(bad.any()):
        raise RequestFailure(
            rid, "level1", f"non-finite retriever score for {int(bad.sum())} of {scores.numel()} chunks"
        )


def _late(delay: Any, rid: str, scores: Any) -> None:
    """`_refuse_non_finite` after `delay.seconds` of sleep on rank `delay.rank` (every rank when None)."""
    from flashmemory.offload.tiered_mirror import dist_rank

    if delay.rank is None or delay.rank == dist_rank():
        time.sleep(delay.seconds)
    _refuse_non_finite(rid, scores)


def guarded(name: str, rids: Callable[[tuple, dict], list[str] | None] | None, state: Any) -> Callable:
    """Decorator: run the hook as `name` under `state.guard` (the process state's guard, read at each call);
    `rids(args, kwargs)` gives its batch's request ids. Wrapping registers `name` with the guard (what
    FLASHMEMORY_FAULT_INJECT may name): the process state builds its guard, so a hook never depends on which
    hook module was imported first."""
    guard = getattr(state, "guard", None)
    if guard is not None and name not in guard.hook_names:
        guard.hook_names += (name,)

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def hook(*args: Any, **kwargs: Any) -> Any:
            return state.guard.run(name, fn, args, kwargs, rids)

        return hook

    return wrap


def batch_rids(pos: int, name: str = "forward_batch") -> Callable[[tuple, dict], list[str] | None]:
    """`rids` for a hook whose forward batch is positional argument `pos` (or keyword `name`)."""

    def get(args: tuple, kwargs: dict) -> list[str] | None:
        fb = args[pos] if len(args) > pos else kwargs.get(name)
        r = getattr(fb, "rids", None)
        return [str(x) for x in r] if r is not None else None

    return get
