"""Level 1: every tau decode steps per request, score the history, pick pages, recall them (off the decode path).

Pipeline per due request: scorer (the retriever over the full target-layer index-K) -> scores [N] ->
`PagePolicy` (scores, history length, budget) -> pages -> `RecallRequest` with page priorities (recency
tail = +inf, then the page's best chunk score) -> `engine.recaller` plan / copy / publish. Level 1 reads the
engine only through its public snapshot (`snapshot_rows`: {row: (gen, n_chunks)}, one lock hold per step) and
queries (`gen`, `target_keys`, `note`); it never takes the engine lock itself. With `async_recall` the
cycle runs on one worker thread and its result applies from a later window; decode keeps using the
previously published set. A request that finishes or whose row is reused before publish is discarded
by the engine's generation check; nothing it planned leaks.

With a `MissMonitor` (`flashmemory.residency.monitored`) each due request is first measured against its
resident set (one rotated native layer over the full history); the request's escalation state then sets the
budget handed to the policy and adds the pages the monitor saw missing (and, in fallback, the latest native
top-k pages) beside the policy's picks.

Lockstep publishing (`publish_lag` > 0, what a tensor-parallel server needs): every rank runs its own Level 1 over
replicated inputs (the same hidden states, index keys and batches), so the ranks' plans agree only if every
change of the resident set happens at the same decode step on every rank. Then the worker computes only the
recall requests (retriever and policy: the slow part, a pure function of the job's inputs); the plan, copy and
publish of a cycle submitted at `on_step` call t run on the decode thread at the start of call t + publish_lag,
waiting for the worker if it is late (counted as `cycles_late`). A failure found for a cycle (e.g. a request's
non-finite scores) is raised at that same call. Nothing the worker's timing decides reaches the resident set.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from flashmemory.offload import streams
from flashmemory.offload.engine import OffloadEngine
from flashmemory.offload.recall import RecallRequest
from flashmemory.residency.policy import PagePolicy, ensemble_scores

if TYPE_CHECKING:
    from flashmemory.residency.monitored import MissMonitor

# (row, n_hist, hidden {target layer: [hidden]}, position [] int) -> scores [n_hist] fp32
Scorer = Callable[[int, int, Mapping[int, torch.Tensor], torch.Tensor], torch.Tensor]


def warm_start(engine: OffloadEngine, row: int, kmax: int) -> int:
    """A newly admitted row's recency-tail warm start (`Recaller.warm_start`; `OffloadEngine.sync_batch` runs it
    for admissions). Returns the pages published."""
    return engine.recaller.warm_start(row, kmax)


@dataclass(frozen=True)
class Level1Config:
    tau: int = 64  # decode steps between cycles of one request
    stagger: bool = False  # spread requests over the tau phases (the first step is always due)
    max_resident_pages: int = 96  # per-request page budget handed to the policy
    last_keep: int = 2048  # recency tail in chunks: +inf priority, dropped last when degrading
    async_recall: bool = True  # run cycles on a worker thread
    publish_lag: int = 0  # 0: publish when the worker is done; k > 0: exactly k on_step calls later

    def __post_init__(self) -> None:
        if self.tau < 1 or self.max_resident_pages < 1 or self.last_keep < 0 or self.publish_lag < 0:
            raise ValueError(
                f"Level1Config: tau and max_resident_pages must be >= 1, last_keep and publish_lag >= 0: {self}"
            )


@dataclass
class _LockstepJob:
    """One cycle in lockstep mode: submitted at on_step call `due - publish_lag`, published at call `due`.
    items: [(row, gen, n_hist, hidden {layer: [hidden]}, position [])]; the worker fills `reqs` or `error`."""

    due: int
    ready: object  # CUDA event the inputs are ready on, or None
    items: list
    done: threading.Event = field(default_factory=threading.Event)
    reqs: list = field(default_factory=list)
    error: BaseException | None = None


def retriever_scorer(retriever, engine: OffloadEngine, ensemble: str = "or") -> Scorer:
    """A `Scorer` from a `flashmemory.retriever.JointRetriever` over the engine's target-layer index-K."""
    missing = [i for i in retriever.layers if i not in engine.layout.target_layers]
    if missing:
        raise ValueError(f"retriever layers {missing} are not target layers {engine.layout.target_layers}")

    @torch.no_grad()
    def score(row: int, n_hist: int, hidden: Mapping[int, torch.Tensor], position: torch.Tensor) -> torch.Tensor:
        per = []
        for lid in retriever.layers:
            keys = engine.target_keys(row, lid)[:n_hist]
            per.append(retriever.layer(lid)(hidden[lid].reshape(1, -1), position.reshape(1), keys)[0])
        return ensemble_scores(per, ensemble)

    return score


class AllPass:
    """Level-1 scorer without a retriever: every chunk passes, so the policy keeps the newest KMAX pages."""

    def __call__(self, row: int, n_hist: int, hidden: object, position: torch.Tensor) -> torch.Tensor:
        return torch.ones(n_hist)


def page_priority(
    scores: torch.Tensor, n_hist: int, pages: torch.Tensor, page_chunks: int, last_keep: int
) -> list[float]:
    """Priority of each page: +inf inside the recency tail, else the page's best chunk score."""
    n_pages = -(-n_hist // page_chunks)
    pad = torch.full((n_pages * page_chunks,), float("-inf"))
    pad[:n_hist] = scores[:n_hist].float().cpu()
    best = pad.view(n_pages, page_chunks).amax(1)
    tail_page = max(0, n_hist - last_keep) // page_chunks if last_keep > 0 else n_pages
    return [float("inf") if int(p) >= tail_page else float(best[int(p)]) for p in pages.tolist()]


class Level1:
    """Cadence + pipeline. Call `on_step` after every decode forward; `wait` joins pending cycles; `close` stops."""

    def __init__(
        self,
        engine: OffloadEngine,
        scorer: Scorer,
        policy: PagePolicy,
        cfg: Level1Config = Level1Config(),
        monitor: MissMonitor | None = None,
    ):  # noqa: F821 (flashmemory.residency.monitored)
        self.engine, self.scorer, self.policy, self.cfg, self.monitor = engine, scorer, policy, cfg, monitor
        pc = getattr(getattr(policy, "cfg", None), "page_chunks", engine.layout.page_chunks)
        if pc != engine.layout.page_chunks:
            raise ValueError(f"policy pages hold {pc} chunks but the offload layout uses {engine.layout.page_chunks}")
        self._state: dict[int, tuple[int, int, int]] = {}  # row -> (gen, step, phase)
        self._pending: set[tuple[int, int]] = set()  # (row, gen) submitted, not yet published
        self._next_phase = 0
        self._mu = threading.Lock()
        self._error: BaseException | None = None
        self._q: queue.Queue = queue.Queue()
        self._tick = 0  # on_step calls so far (the lockstep clock)
        self._lockstep: deque[_LockstepJob] = deque()  # submitted, not yet published, in due order
        self._worker: threading.Thread | None = None
        if cfg.async_recall:
            self._worker = threading.Thread(target=self._loop, name="flashmemory-level1", daemon=True)
            self._worker.start()

    def on_step(self, rows: Sequence[int], hidden: Mapping[int, torch.Tensor], positions: torch.Tensor) -> list[int]:
        """rows: [B] engine rows (-1 = padding); hidden: {target layer: [B, hidden]}; positions: [B].
        Advances each row's step and submits the due ones. Returns the rows submitted this step.
        Lockstep: first publishes the cycles due at this call (raising their failure after submitting)."""
        if self.cfg.publish_lag:
            self._tick += 1
            late = self._publish_due(self._tick)
            try:
                return self._submit(rows, hidden, positions)
            finally:
                if late is not None:
                    raise RuntimeError("Level-1 cycle failed") from late
        self._raise()
        return self._submit(rows, hidden, positions)

    def tick(self) -> None:
        """A decode step with no row for Level 1: in lockstep the clock still advances (every rank counts every
        decode step alike, whatever its rows) and the cycles due now publish; otherwise nothing happens."""
        if self.cfg.publish_lag:
            self._tick += 1
            late = self._publish_due(self._tick)
            if late is not None:
                raise RuntimeError("Level-1 cycle failed") from late

    def _submit(self, rows: Sequence[int], hidden: Mapping[int, torch.Tensor], positions: torch.Tensor) -> list[int]:
        """Advance each row's cadence and queue the due rows' cycle (see `on_step`)."""
        due: list[tuple[int, int, int, int]] = []  # (batch index, row, gen, n_hist)
        eng = self.engine
        live = eng.snapshot_rows()  # {row: (gen, n_chunks)}; decode (this thread) is what changes it
        with self._mu:
            for i, row in enumerate(int(r) for r in rows):
                if row < 0 or row not in live:
                    continue
                gen, n_hist = live[row]
                g, step, phase = self._state.get(row, (None, 0, 0))
                if g != gen:  # new occupant of the row: its first step is due at once
                    step, phase = 0, (self._next_phase if self.cfg.stagger else 0)
                    self._next_phase = (self._next_phase + 1) % self.cfg.tau
                if step == 0 or step % self.cfg.tau == phase:
                    if (row, gen) in self._pending:
                        eng.note(row, "cycles_skipped")
                    else:
                        self._pending.add((row, gen))
                        due.append((i, row, gen, n_hist))
                self._state[row] = (gen, step + 1, phase)
            for row in [r for r in self._state if r not in live]:
                del self._state[row]
        if self.monitor is not None:  # finished or replaced requests give their budget grant back now
            self.monitor.sync({r: g for r, (g, _) in live.items()})
        if not due:
            return []
        idx = torch.tensor([d[0] for d in due])
        job = [
            (
                row,
                gen,
                n,
                {lid: h.index_select(0, streams.like(idx, h))[j].clone() for lid, h in hidden.items()},
                positions.reshape(-1)[idx[j]].clone(),
            )
            for j, (_, row, gen, n) in enumerate(due)
        ]
        if self.cfg.publish_lag:
            ready = None
            if self._worker is not None and any(h.is_cuda for h in hidden.values()):
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream())
            lj = _LockstepJob(self._tick + self.cfg.publish_lag, ready, job)
            self._lockstep.append(lj)
            if self._worker is None:
                self._score(lj)
            else:
                self._q.put(lj)
        elif self._worker is None:
            self._run((None, job))
        else:
            # The clones above are queued on this thread's current CUDA stream; the worker's scorer runs on
            # another stream, so it waits for them on an event (not a host sync) before reading.
            ready = None
            if any(h.is_cuda for h in hidden.values()):
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream())
            job = (ready, job)
            if self._q.unfinished_tasks:
                for _, row, _, _ in due:
                    eng.note(row, "cycles_late")
            self._q.put(job)
        return [d[1] for d in due]

    def _requests(self, job: list) -> list[RecallRequest]:
        """job: [(row, gen, n_hist, hidden, position)] -> the cycle's recall requests (scorer, policy, monitor)."""
        reqs = []
        for row, gen, n, hid, pos in job:
            try:
                if self.engine.gen(row) != gen:
                    continue
                budget, extra, extra_prio = self.cfg.max_resident_pages, [], []
                if self.monitor is not None:
                    budget, extra, extra_prio = self.monitor.cycle(row, gen, n, hid, pos)
                scores = self.scorer(row, n, hid, pos)
            except KeyError:  # finished while queued
                continue
            pages = self.policy(scores, n, budget).reshape(-1).cpu()
            pages = pages[pages >= 0]
            prio = page_priority(scores, n, pages, self.engine.layout.page_chunks, self.cfg.last_keep)
            if self.monitor is not None:
                from flashmemory.residency.monitored import merge_selection

                pages, prio = merge_selection(pages.tolist(), prio, extra, extra_prio, budget)
            reqs.append(
                RecallRequest(
                    row,
                    gen,
                    tuple(int(p) for p in pages),
                    tuple(prio),
                    budget=budget if self.monitor is not None else None,
                )
            )
        return reqs

    def _run(self, item: tuple) -> None:
        """item: (CUDA event the inputs are ready on, or None; [(row, gen, n_hist, hidden, position)])."""
        ready, job = item
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)
        try:
            reqs = self._requests(job)
            self.engine.recaller.prefetch(reqs)  # cold pages start reading from disk before the plan
            self.engine.recaller.recall(reqs)  # a failed copy is cancelled: nothing published
        finally:
            with self._mu:
                for row, gen, *_ in job:
                    self._pending.discard((row, gen))

    def _score(self, lj: _LockstepJob) -> None:
        """Lockstep worker side: the job's recall requests, or its error; never touches the resident set."""
        try:
            if lj.ready is not None:
                torch.cuda.current_stream().wait_event(lj.ready)
            lj.reqs = self._requests(lj.items)
            self.engine.recaller.prefetch(lj.reqs)  # disk reads run now, not at the publish on the decode thread
        except BaseException as e:  # raised on the decode thread at the job's publish call
            lj.error = e
        finally:
            lj.done.set()

    def _publish_due(self, tick: int | None) -> BaseException | None:
        """Decode thread, lockstep: plan, copy and publish every job due at `tick` (None: every job), in submit
        order, waiting for the worker where it is late. Returns the first failure (the others' pages publish)."""
        first: BaseException | None = None
        while self._lockstep and (tick is None or self._lockstep[0].due <= tick):
            lj = self._lockstep.popleft()
            if not lj.done.is_set():
                for row, *_ in lj.items:
                    self.engine.note(row, "cycles_late")
                lj.done.wait()
            try:
                if lj.error is not None:
                    raise lj.error
                self.engine.recaller.recall(lj.reqs, wait=False)  # the forward stream waits for the copy, not the host
            except BaseException as e:  # noqa: BLE001 - raised by on_step / wait after the due jobs published
                first = first or e
            finally:
                with self._mu:
                    for row, gen, *_ in lj.items:
                        self._pending.discard((row, gen))
        return first

    def _loop(self) -> None:
        self.engine.order.set_device()  # before any CUDA call: a new thread's current device is GPU 0 on every rank
        while True:
            job = self._q.get()
            try:
                if job is None:
                    return
                if isinstance(job, _LockstepJob):
                    self._score(job)
                    continue
                self._run(job)
            except BaseException as e:  # surfaced on the decode thread at the next call
                self._error = e
            finally:
                self._q.task_done()

    def _raise(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError("Level-1 worker failed") from e

    def queued(self) -> int:
        """Cycles handed to the worker thread and not finished by it (0 without a worker)."""
        return self._q.unfinished_tasks if self._worker is not None else 0

    def wait(self) -> None:
        """Block until every submitted cycle has published (or been discarded)."""
        if self._worker is not None:
            self._q.join()
        late = self._publish_due(None)
        if late is not None:
            raise RuntimeError("Level-1 cycle failed") from late
        self._raise()

    def close(self) -> None:
        if self._worker is not None and self._worker.is_alive():
            self._q.put(None)
            self._worker.join()
        self._worker = None
