"""One prefill per document, shared by every method and budget of a frontier sweep.

A method's quality forward (`eval.decode.method_quality`) restricts only the decode rows P .. P+T-1: the prompt
rows attend the full history (the prefill is dense under every method), so their keys, values, compressor and
indexer state are the same for every method. `PrefixDecoder` prefills the prompt once into a cache, then per
method copies that cache and runs the T decode rows one token at a time (teacher-forced on Full's response) with
the method's per-row resident set. Its `forward` has the shape of `HFEngine.forward`'s logits, so the harness
(`eval.harness.evaluate_doc`) runs unchanged on it: rows before P are zero (nothing reads them) and rows P .. P+T-1
equal `HFEngine.forward(ids, resident=...)`'s up to float error (tests/eval/frontier/test_decode.py checks it).

Cost: a full forward over S = P + T tokens per method becomes a cache copy plus T one-token steps; at P = 4096
that is the difference between minutes and seconds per document over a 6-budget x 4-method sweep.

Batched: `forward_many` decodes the T rows of several resident sets at once (the prompt cache repeated to batch
B, each batch row masked with its own set by `BatchResidentHooks`), so a sweep's method x budget forwards cost
T batched steps instead of B x T single ones; equal resident sets are decoded once. `ServedLogits` hands each
result back through the `HFEngine.forward` interface, looked up by the resident mask's content (never by
method or budget), so a metric can only ever read the logits of the very set it passes.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache

from flashmemory.eval.decode import DocRun, capture_run
from flashmemory.hf.capture import NEG_INF, IndexerHooks, _arg
from flashmemory.hf.engine import torch_threads


@dataclass
class Forced:
    """What the harness reads from a forward: logits [S, vocab] fp32 (rows < P zero)."""

    logits: Tensor


def batch_cache(cache: DynamicCache, n: int) -> DynamicCache:
    """A copy of a batch-1 `cache` whose per-request tensors (sliding-window keys/values, compressor buffers,
    compressed entries, overlap state: every tensor or dict-of-tensors attribute with a leading batch dim of 1)
    are repeated to batch n; scalars and 0-d tensors are shared. Tensors that alias each other (V4's keys and
    values are one tensor) still alias in the copy. The source cache is left untouched."""
    memo: dict[int, Tensor] = {}

    def rep(v):
        if not isinstance(v, Tensor) or v.dim() == 0:
            return v
        if v.shape[0] != 1:
            raise ValueError(f"batch_cache: expected a batch-1 cache tensor, got shape {tuple(v.shape)}")
        if id(v) not in memo:
            memo[id(v)] = v.expand(n, *v.shape[1:]).clone()
        return memo[id(v)]

    out = copy.copy(cache)
    out.layers = []
    for layer in cache.layers:
        new = copy.copy(layer)
        for k, v in vars(layer).items():
            setattr(new, k, {a: rep(b) for a, b in v.items()} if isinstance(v, dict) else rep(v))
        out.layers.append(new)
    return out


class BatchResidentHooks(IndexerHooks):
    """`IndexerHooks` for a batch of B one-token decode rows at the same position, each batch row restricted to
    its own resident set: resident bool [B, R, N] (R >= every query position + 1, N >= every entry count).
    Non-resident entries get -inf before top-k and are never attended, exactly as `IndexerHooks` does for B = 1;
    nothing is recorded."""

    def __init__(self, model, config, resident: Tensor):
        super().__init__(model, config, resident=None, record=False)
        if resident.dim() != 3 or resident.dtype != torch.bool:
            raise ValueError(
                f"BatchResidentHooks: expected bool [B, R, N], got {resident.dtype} {tuple(resident.shape)}"
            )
        self.batch_resident = resident

    def _pre_hook(self, cid: int):
        def hook(module, args, kwargs):
            pos = _arg(args, kwargs, 2, "position_ids")  # [1 or B, S]: the same positions in every batch row
            if pos.shape[0] > 1 and not bool((pos == pos[:1]).all()):
                raise ValueError("BatchResidentHooks: batch rows must sit at the same positions")
            self._positions[cid] = pos[0]

        return hook

    def _scorer_hook(self, cid: int):
        def hook(module, args, kwargs, scores):  # scores [B, S, n]
            pos = self._positions[cid]
            n = scores.shape[-1]
            res = self.batch_resident
            if res.shape[0] != scores.shape[0] or res.shape[2] < n or int(pos.max()) >= res.shape[1]:
                raise ValueError(
                    f"BatchResidentHooks: resident {tuple(res.shape)} does not cover scores "
                    f"{tuple(scores.shape)} at position {int(pos.max())}"
                )
            future = torch.arange(n, device=scores.device).unsqueeze(0) >= ((pos + 1) // self.ratio).unsqueeze(1)
            scores = scores.masked_fill(~res[:, pos, :n], NEG_INF)
            self._masked[cid] = scores.masked_fill(future.unsqueeze(0), NEG_INF)
            return scores

        return hook


class PrefixDecoder:
    """An `HFEngine` stand-in for one document whose prompt (P tokens) is prefilled once.

    engine: the `HFEngine`; prompt_ids: the P prompt tokens. After `generate(T)` (Full's greedy decode from the
    cache) `forward(ids, resident)` serves the harness's Level-2 forwards for ids = prompt + response."""

    def __init__(self, engine, prompt_ids: list[int]):
        self.engine = engine
        self.index_topk = engine.index_topk
        self.prompt = list(prompt_ids)
        ids = engine._ids(self.prompt, "prompt_ids")
        self.cache = DynamicCache(config=engine.config)
        with (
            torch.no_grad(),
            IndexerHooks(engine.model, engine.config, resident=None, record=False),
            torch_threads(engine.num_threads),
        ):
            out = engine.model(input_ids=ids.unsqueeze(0), past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.first_logits = out.logits[0, -1].float()  # predicts response token 0
        self.forced_forwards = 0

    def generate(self, max_new_tokens: int, step_times: list[float] | None = None) -> list[int]:
        """Full attention's greedy response (max_new_tokens tokens) from a copy of the prompt cache."""
        cache = copy.deepcopy(self.cache)
        new = [int(self.first_logits.argmax())]
        m = self.engine.model
        with (
            torch.no_grad(),
            IndexerHooks(m, self.engine.config, resident=None, record=False),
            torch_threads(self.engine.decode_threads),
        ):
            while len(new) < max_new_tokens:
                step = torch.tensor([[new[-1]]], dtype=torch.long, device=self.engine.device)
                t0 = time.perf_counter()
                logits = m(input_ids=step, past_key_values=cache, use_cache=True).logits
                if step_times is not None:
                    step_times.append(time.perf_counter() - t0)
                new.append(int(logits[0, -1].argmax()))
        return new

    @torch.no_grad()
    def forward(self, input_ids: list[int] | Tensor, resident: Tensor | None = None, capture_layers=None) -> Forced:
        """Logits [S, vocab] of ids = prompt + response (S = P + T) with `resident` [S, N_c] bool per query row
        (rows < P must be all True: the prefill was dense), decode rows only; rows < P are returned as zeros."""
        eng = self.engine
        ids = eng._ids(input_ids)
        P, S = len(self.prompt), int(ids.shape[0])
        if S <= P or ids[:P].tolist() != self.prompt:
            raise ValueError("PrefixDecoder.forward: ids must extend the prefilled prompt")
        res = eng._resident(resident, S, eng.n_compressed(S)) if resident is not None else None
        if res is not None and res.dim() == 2 and not bool(res[:P].all()):
            raise ValueError("PrefixDecoder.forward: prompt rows must see every entry (the prefill is dense)")
        cache = copy.deepcopy(self.cache)
        out = torch.zeros(S, eng.vocab_size)
        with IndexerHooks(eng.model, eng.config, resident=res, record=False), torch_threads(eng.decode_threads):
            for t in range(P, S):
                lg = eng.model(input_ids=ids[t : t + 1].unsqueeze(0), past_key_values=cache, use_cache=True).logits
                out[t] = lg[0, -1].float()
        self.forced_forwards += 1
        return Forced(out)

    @torch.no_grad()
    def forward_many(self, input_ids: list[int] | Tensor, residents: list[Tensor], batch: int = 32) -> list[Tensor]:
        """Decode-row logits [T, vocab] fp32 of ids = prompt + response (S = P + T) under each resident set
        (bool [S, N_c], prompt rows all True), as `forward(ids, r).logits[P:]` up to float error, in the order
        given. Equal sets are decoded once; the distinct ones go `batch` at a time through one batched decode
        from a repeated prompt cache. Counts one forced forward per set asked for."""
        eng = self.engine
        ids = eng._ids(input_ids)
        P, S = len(self.prompt), int(ids.shape[0])
        if S <= P or ids[:P].tolist() != self.prompt:
            raise ValueError("PrefixDecoder.forward_many: ids must extend the prefilled prompt")
        uniq: list[Tensor] = []
        slot: list[int] = []
        seen: dict[bytes, int] = {}
        for r in residents:
            r = eng._resident(r, S, eng.n_compressed(S))
            if r.dim() != 2 or not bool(r[:P].all()):
                raise ValueError("PrefixDecoder.forward_many: give [S, N_c] sets whose prompt rows see every entry")
            key = _set_key(r, P)
            if key not in seen:
                seen[key] = len(uniq)
                uniq.append(r)
            slot.append(seen[key])
        done: list[Tensor] = []
        for lo in range(0, len(uniq), batch):
            group = torch.stack(uniq[lo : lo + batch])  # [B, S, N_c]
            B = group.shape[0]
            cache = batch_cache(self.cache, B)
            rows = torch.empty(B, S - P, eng.vocab_size)
            with BatchResidentHooks(eng.model, eng.config, group), torch_threads(eng.decode_threads):
                for t in range(P, S):
                    step = ids[t : t + 1].view(1, 1).expand(B, 1)
                    lg = eng.model(input_ids=step, past_key_values=cache, use_cache=True).logits
                    rows[:, t - P] = lg[:, -1].float()
            done.extend(rows.unbind(0))
        self.forced_forwards += len(residents)
        return [done[j] for j in slot]


class ServedLogits:
    """An `HFEngine` stand-in for `eval.decode.method_quality`: `forward(ids, resident)` returns the logits that
    `PrefixDecoder.forward_many` computed for exactly that resident mask (bool [S, N_c], compared by content),
    rows < P zero as `PrefixDecoder.forward`'s; a mask it was not given is a KeyError, never another set's rows."""

    def __init__(self, index_topk: int, prompt_len: int, masks: list[Tensor], rows: list[Tensor]):
        if len(masks) != len(rows):
            raise ValueError(f"ServedLogits: {len(masks)} masks but {len(rows)} logit blocks")
        self.index_topk = index_topk
        self.prompt_len = prompt_len
        self._served = {_set_key(m, prompt_len): r for m, r in zip(masks, rows)}
        self._out: Tensor | None = None

    def forward(self, input_ids, resident: Tensor | None = None, capture_layers=None) -> Forced:
        """Logits [S, vocab] of the set `resident` (bool [S, N_c], prompt rows all True). The returned tensor is
        one buffer reused by the next call: read it before asking again (method_quality does)."""
        if resident is None:
            raise KeyError("ServedLogits: Full attention's logits come from the capture, not from here")
        if not bool(resident[: self.prompt_len].all()):
            raise KeyError("ServedLogits: a set restricting a prompt row was never decoded here")
        rows = self._served.get(_set_key(resident, self.prompt_len))
        if rows is None:
            raise KeyError("ServedLogits: no logits were computed for this resident set")
        S = self.prompt_len + rows.shape[0]
        if self._out is None or self._out.shape != (S, rows.shape[1]):
            self._out = torch.zeros(S, rows.shape[1])
        self._out[self.prompt_len :] = rows
        return Forced(self._out)


def _set_key(mask: Tensor, prompt_len: int) -> bytes:
    """A resident set's identity: its shape and decode rows (bool [S, N_c]; the prompt rows are all True)."""
    d = mask[prompt_len:]
    return repr(tuple(mask.shape)).encode() + d.contiguous().numpy().tobytes()


def cached_full_run(
    engine,
    name: str,
    prompt_ids: list[int],
    max_new_tokens: int,
    target_layers: tuple[int, ...],
    topp: float = 0.6,
    min_layers: int = 3,
    record: dict | None = None,
) -> tuple[DocRun, PrefixDecoder]:
    """`eval.decode.full_run` with the prompt prefilled once: (the Full run, the decoder the methods reuse).
    Same fields as full_run's DocRun (one capture forward over prompt + response); `cap` is dropped."""
    dec = PrefixDecoder(engine, prompt_ids)
    times: list[float] = []
    response = dec.generate(max_new_tokens, times)
    step_s = sum(times) / len(times) if times else 0.0
    run = capture_run(engine, name, prompt_ids, response, step_s, target_layers, topp, min_layers, record, False)
    return run, dec
