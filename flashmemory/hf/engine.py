"""CPU reference engine over transformers' `DeepseekV4ForCausalLM`: teacher-forced capture of the
c4 lightning indexers, the Level-2 residency restriction, and greedy generation.

`forward` runs ONE full forward (no cache) and returns logits plus, per c4 layer, the native
indexer logits, the top-k picks actually attended, and (for `capture_layers`) the indexer-input
hidden states and compressed index keys. See `flashmemory.hf.capture` for how transformers
computes the indexer and where the hooks sit.

`generate` prefills once into transformers' DynamicCache, then decodes one token per step.
Against repeated full forwards this wins by far: on micro a decode step costs ~0.02 s while one
full 1024-token forward costs ~0.5 s (tiny-flash: ~0.25 s vs ~2.3 s).

Threads: a decode step is hundreds of tiny ops, where torch's intra-op threads only add sync cost;
on an oversubscribed CPU they cost 10x or more (tiny-flash step 3.3 s at 2 threads vs 0.25 s at 1).
So decode steps run with `decode_threads` (default 1) threads; `num_threads` (default: leave
torch's setting) applies to full forwards and prefill. Both are restored on return.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache

from flashmemory.hf.capture import IndexerHooks
from flashmemory.hf.layers import c4_layer_ids, c4_ratio, check_c4_ids
from flashmemory.retriever.fp8 import dequantize_chunks, quantize_chunks
from flashmemory.retriever.hadamard import hadamard_transform


@dataclass
class ForwardCapture:
    """One teacher-forced forward over S tokens; dicts are keyed by c4-layer id.

    logits:       [S, vocab] fp32; row t predicts token t+1.
    hidden:       id -> [S, hidden] fp32 indexer-input hidden (attention input of the c4 layer).
    index_logits: id -> [S, N_c] fp32 native indexer logits (before any residency mask),
                  -inf exactly where j >= (t+1)//4; N_c = S//4.
    index_keys:   id -> [N_c, index_head_dim] fp32 compressed index keys (post-RMSNorm/RoPE,
                  un-rotated: see `stored_index_keys` for sglang's stored form).
    topk:         id -> [S, index_topk] int64 entries attended by query t, in descending score
                  order, -1 for invalid picks (not yet visible, non-resident, or padding when
                  N_c < index_topk).
    """

    logits: Tensor
    hidden: dict[int, Tensor]
    index_logits: dict[int, Tensor]
    index_keys: dict[int, Tensor]
    topk: dict[int, Tensor]


def stored_index_keys(keys: Tensor) -> Tensor:
    """Index keys as sglang stores them: Hadamard-rotate, then fp8 chunks.

    keys: [N, D] float, D a power of two -> [N, D+4] uint8 (D e4m3 bytes + fp32 scale).
    """
    if keys.dim() != 2:
        raise ValueError(f"stored_index_keys expects keys [N, D], got {tuple(keys.shape)}")
    return quantize_chunks(hadamard_transform(keys.float()))


def unstored_index_keys(chunks: Tensor) -> Tensor:
    """Inverse of `stored_index_keys` up to fp8 error: [N, D+4] uint8 -> [N, D] fp32 un-rotated keys."""
    return hadamard_transform(dequantize_chunks(chunks))


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with `n` torch intra-op threads (None: unchanged), then restore the old count."""
    if n is None:
        yield
        return
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class HFEngine:
    """Reference engine for one DeepSeek-V4 model (batch size 1, no grad, eager attention)."""

    def __init__(self, model, config, num_threads: int | None = None, decode_threads: int | None = 1):
        self.num_threads = num_threads
        self.decode_threads = decode_threads
        self.model = model.eval()
        self.config = config
        self.c4_layers: list[int] = c4_layer_ids(config)
        if not self.c4_layers:
            raise ValueError("config has no compressed_sparse_attention (c4) layers")
        self.ratio: int = c4_ratio(config)
        if self.ratio != 4:
            raise ValueError(f"c4 compression ratio is {self.ratio}; the engine assumes 4")
        self.n_c4_layers: int = len(self.c4_layers)
        self.index_topk: int = int(config.index_topk)
        self.index_head_dim: int = int(config.index_head_dim)
        self.index_n_heads: int = int(config.index_n_heads)
        self.hidden_size: int = int(config.hidden_size)
        self.vocab_size: int = int(config.vocab_size)
        self.device = next(model.parameters()).device

    @classmethod
    def from_name(cls, name_or_path: str, seed: int = 0, dtype: torch.dtype = torch.float32, **kwargs) -> "HFEngine":
        """`HFEngine(*load_model(name_or_path, seed, dtype), **kwargs)`."""
        from flashmemory.hf.models import load_model

        return cls(*load_model(name_or_path, seed, dtype), **kwargs)

    def n_compressed(self, seq_len: int) -> int:
        """Compressed c4 entries after `seq_len` tokens (complete windows only)."""
        return seq_len // self.ratio

    # ---- input checks -------------------------------------------------------------------------
    def _ids(self, input_ids, what: str = "input_ids") -> Tensor:
        ids = torch.as_tensor(input_ids, dtype=torch.long) if not isinstance(input_ids, Tensor) else input_ids
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"{what}: expected a non-empty [S] token list, got shape {tuple(ids.shape)}")
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise ValueError(f"{what}: expected integer token ids, got {ids.dtype}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(f"{what}: token ids must lie in [0, {self.vocab_size}), got [{lo}, {hi}]")
        return ids.long().to(self.device)

    def _resident(self, resident, n_rows: int, n_entries: int) -> Tensor | None:
        """Validate a residency mask for queries 0..n_rows-1 that see up to n_entries entries."""
        if resident is None:
            return None
        r = torch.as_tensor(resident)
        if r.dtype != torch.bool:
            raise ValueError(f"resident: expected a bool mask, got {r.dtype}")
        if r.dim() == 1:
            ok = r.shape[0] >= n_entries
        elif r.dim() == 2:
            ok = r.shape[0] == n_rows and r.shape[1] >= n_entries
        else:
            ok = False
        if not ok:
            raise ValueError(
                f"resident: expected bool [N_c>={n_entries}] or [{n_rows}, N_c>={n_entries}], got {tuple(r.shape)}"
            )
        return r.to(self.device)

    # ---- teacher-forced capture ---------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self, input_ids: Tensor | list[int], resident: Tensor | None = None, capture_layers: Iterable[int] | None = None
    ) -> ForwardCapture:
        """One full forward over input_ids [S] (no cache); see `ForwardCapture` for the outputs.

        resident: None, bool [N_c] (all queries) or [S, N_c] (per query), True = resident; extra
        columns beyond N_c = S//4 are ignored. Non-resident entries get -inf before top-k in every
        c4 layer and are never attended. capture_layers: c4 ids for hidden/index_keys (None = all).
        """
        ids = self._ids(input_ids)
        s = ids.shape[0]
        res = self._resident(resident, s, self.n_compressed(s))
        n = self.n_c4_layers
        cap = list(range(n)) if capture_layers is None else check_c4_ids(capture_layers, n)
        with (
            torch_threads(self.num_threads),
            IndexerHooks(self.model, self.config, resident=res, capture=cap, record=True) as hooks,
        ):
            out = self.model(input_ids=ids.unsqueeze(0), use_cache=False)
        rec = hooks.record
        missing = [c for c in range(self.n_c4_layers) if c not in rec.topk]
        if missing:
            raise RuntimeError(f"indexer hooks did not fire for c4 layers {missing}")
        return ForwardCapture(
            logits=out.logits[0].float(),
            hidden=rec.hidden,
            index_logits=rec.index_logits,
            index_keys=rec.index_keys,
            topk=rec.topk,
        )

    # ---- cached decode ------------------------------------------------------------------------
    @torch.no_grad()
    def incremental_logits(
        self, input_ids: Tensor | list[int], prefill_len: int, resident: Tensor | None = None
    ) -> Tensor:
        """Logits [S, vocab] fp32 from a cached prefill of the first `prefill_len` tokens followed by
        one-token decode steps; equals `forward(...).logits` up to float error (the parity check)."""
        ids = self._ids(input_ids)
        s = ids.shape[0]
        if not 1 <= prefill_len <= s:
            raise ValueError(f"prefill_len={prefill_len} must lie in [1, {s}]")
        res = self._resident(resident, s, self.n_compressed(s))
        cache = DynamicCache(config=self.config)
        rows = []
        with IndexerHooks(self.model, self.config, resident=res, record=False):
            with torch_threads(self.num_threads):
                out = self.model(input_ids=ids[:prefill_len].unsqueeze(0), past_key_values=cache, use_cache=True)
            rows.append(out.logits[0].float())
            with torch_threads(self.decode_threads):
                for t in range(prefill_len, s):
                    out = self.model(input_ids=ids[t : t + 1].unsqueeze(0), past_key_values=cache, use_cache=True)
                    rows.append(out.logits[0].float())
        return torch.cat(rows, dim=0)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        resident: Tensor | None = None,
        eos_token_id: int | None = None,
        step_times: list[float] | None = None,
    ) -> list[int]:
        """Greedy decode: the new tokens only (at most `max_new_tokens`; stops after `eos_token_id`
        if given). resident: None or bool [N_c_max] with N_c_max >= (len(prompt)+max_new_tokens-1)//4
        (a [S_max, N_c_max] per-position mask also works). step_times: if given, the wall seconds of
        each one-token decode forward are appended to it (the prefill is not among them)."""
        ids = self._ids(prompt_ids, "prompt_ids")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
        if max_new_tokens == 0:
            return []
        s_max = ids.shape[0] + max_new_tokens - 1  # the last new token is never fed back
        res = None
        if resident is not None:
            r = torch.as_tensor(resident)
            res = self._resident(r, r.shape[0] if r.dim() == 2 else s_max, self.n_compressed(s_max))
            if res.dim() == 2 and res.shape[0] < s_max:
                raise ValueError(f"resident: per-position mask has {res.shape[0]} rows, needs {s_max}")
        cache = DynamicCache(config=self.config)
        new: list[int] = []
        with IndexerHooks(self.model, self.config, resident=res, record=False):
            with torch_threads(self.num_threads):
                logits = self.model(
                    input_ids=ids.unsqueeze(0), past_key_values=cache, use_cache=True, logits_to_keep=1
                ).logits
            with torch_threads(self.decode_threads):
                while True:
                    tok = int(logits[0, -1].argmax())
                    new.append(tok)
                    if len(new) >= max_new_tokens or tok == eos_token_id:
                        return new
                    step = torch.tensor([[tok]], dtype=torch.long, device=self.device)
                    t0 = time.perf_counter()
                    logits = self.model(input_ids=step, past_key_values=cache, use_cache=True).logits
                    if step_times is not None:
                        step_times.append(time.perf_counter() - t0)
