"""HiSparse's arms of a frontier sweep: its LRU swap-in replayed over the Full run's own top-k picks, alone and
with FlashMemory's resident set as a prefetch hint at each Level-1 cycle (`eval.hisparse_replay`)."""

from __future__ import annotations

import torch


def hisparse_stats(run, slots: int, hint: dict[int, torch.Tensor] | None = None) -> dict | None:
    """HiSparse's LRU swap-in replayed over the Full run's decode-row picks of every c4 layer with a hot buffer of
    `slots` entries: {"hits", "misses", "hit_rate", "fast_path_calls", "calls"} summed over layers and steps
    (sglang's PD admission: a request longer than the buffer starts it empty; hit rate 1 on the fast path,
    history <= slots); None while the replay module is not installed (the report then marks the HiSparse cost
    columns pending)."""
    try:
        from flashmemory.eval.hisparse_replay import replay_hisparse
    except ImportError:
        return None
    P, T = run.prompt_len, run.n_steps
    picks = []
    for c in sorted(run.topk):
        rows = run.topk[c][P : P + T]
        picks.append([r[r >= 0].long() for r in rows])
    lengths = [min((P + t + 1) // 4, run.index_chunks.shape[1]) for t in range(T)]
    st = replay_hisparse(picks, lengths, slots, hint)
    out = {
        "hits": float(st.hits),
        "misses": float(st.misses),
        "hit_rate": float(st.hit_rate),
        "fast_path_calls": float(st.fast_path_calls),
        "calls": float(st.calls),
    }
    if hint is not None:
        out |= {
            "prefetched": float(st.prefetched),
            "prefetch_hits": float(st.prefetch_hits),
            "prefetch_wasted": float(st.prefetch_wasted),
        }
    return out


def prefetch_hint(resident: torch.Tensor, tau: int) -> dict[int, torch.Tensor]:
    """FlashMemory's resident set at each Level-1 cycle start (step t, t % tau == 0) as a HiSparse prefetch hint:
    step -> its resident chunk positions, ascending (the replay keeps the first slots - k). resident: bool [T, N_c]."""
    return {t: resident[t].nonzero().squeeze(1) for t in range(0, resident.shape[0], tau)}
