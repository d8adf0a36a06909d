"""One prefill per document, shared by every method and budget of a frontier sweep.

A method's quality forward (`eval.decode.method_quality`) restricts only the decode rows P .. P+T-1: the prompt
rows attend the full history (the prefill is dense under every method), so their keys, values, compressor and
indexer state are the same for every method. `PrefixDecoder` prefills the prompt once into a cache, then per
method copies that cache and runs the T decode rows one token at a time (teacher-forced on Full's response) with
the method's per-row resident set. Its `forward` has the shape of `HFEngine.forward`'s logits, so the harness
(`eval.harness.evaluate_doc`) runs unchanged on it: rows before P are zero (nothing reads them) and rows P .. P+T-1
equal `HFEngine.forward(ids, resident=...)`'s up to float error (tests/eval/test_frontier_decode.py checks it).

Cost: a full forward over S = P + T tokens per method becomes a cache copy plus T one-token steps; at P = 4096
that is the difference between minutes and seconds per document over a 6-budget x 4-method sweep.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache

from flashmemory.eval.decode import DocRun
from flashmemory.hf.capture import IndexerHooks
from flashmemory.hf.engine import torch_threads


@dataclass
class Forced:
    """What the harness reads from a forward: logits [S, vocab] fp32 (rows < P zero)."""

    logits: Tensor


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
        with torch.no_grad(), IndexerHooks(engine.model, engine.config, resident=None, record=False), \
                torch_threads(engine.num_threads):
            out = engine.model(input_ids=ids.unsqueeze(0), past_key_values=self.cache, use_cache=True,
                               logits_to_keep=1)
        self.first_logits = out.logits[0, -1].float()   # predicts response token 0
        self.forced_forwards = 0

    def generate(self, max_new_tokens: int, step_times: list[float] | None = None) -> list[int]:
        """Full attention's greedy response (max_new_tokens tokens) from a copy of the prompt cache."""
        cache = copy.deepcopy(self.cache)
        new = [int(self.first_logits.argmax())]
        m = self.engine.model
        with torch.no_grad(), IndexerHooks(m, self.engine.config, resident=None, record=False), \
                torch_threads(self.engine.decode_threads):
            while len(new) < max_new_tokens:
                step = torch.tensor([[new[-1]]], dtype=torch.long, device=self.engine.device)
                t0 = time.perf_counter()
                logits = m(input_ids=step, past_key_values=cache, use_cache=True).logits
                if step_times is not None:
                    step_times.append(time.perf_counter() - t0)
                new.append(int(logits[0, -1].argmax()))
        return new

    @torch.no_grad()
    def forward(self, input_ids: list[int] | Tensor, resident: Tensor | None = None,
                capture_layers=None) -> Forced:
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
                lg = eng.model(input_ids=ids[t:t + 1].unsqueeze(0), past_key_values=cache, use_cache=True).logits
                out[t] = lg[0, -1].float()
        self.forced_forwards += 1
        return Forced(out)


def cached_full_run(engine, name: str, prompt_ids: list[int], max_new_tokens: int, target_layers: tuple[int, ...],
                    topp: float = 0.6, min_layers: int = 3, record: dict | None = None) -> tuple[DocRun, PrefixDecoder]:
    """`eval.decode.full_run` with the prompt prefilled once: (the Full run, the decoder the methods reuse).
    Same fields as full_run's DocRun (one capture forward over prompt + response); `cap` is dropped."""
    from flashmemory.hf import stored_index_keys
    from flashmemory.labels.golden import golden_labels
    dec = PrefixDecoder(engine, prompt_ids)
    times: list[float] = []
    response = dec.generate(max_new_tokens, times)
    ids = list(prompt_ids) + response
    cap = engine.forward(ids, capture_layers=None)
    P, T = len(prompt_ids), len(response)
    n_c4 = engine.n_c4_layers
    labels = golden_labels([cap.index_logits[c][P:P + T] for c in range(n_c4)], topk=engine.index_topk,
                           topp=topp, min_layers=min_layers)
    chunks = torch.stack([stored_index_keys(cap.index_keys[c]) for c in range(n_c4)])
    run = DocRun(name, list(prompt_ids), response, cap.logits, cap.index_logits, cap.topk,
                 {c: cap.hidden[c] for c in target_layers}, chunks, labels,
                 sum(times) / len(times) if times else 0.0, None, record)
    return run, dec
