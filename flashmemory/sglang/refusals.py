"""Server configurations FlashMemory cannot honour, refused at start-up with one line each naming the flag.

`refusals(server_args, env, features, shrink)` is a pure function of sglang's server args (flat attributes of
sglang 0.5.23's `ServerArgs`) and the gates; `refuse` raises `StartupError` (a SystemExit: sglang's
`load_plugins` and the scheduler's hook calls let it through, so the process stops with the message). They run
where the server args are final: when the pool is attached in the scheduler process, and again before CUDA-graph
capture with the model runner's own `max_running_requests`.

What is refused and why:
- `--enable-two-batch-overlap`: each micro-batch runs its own forward over half the rows, but the Level-2
  buffers, the side band and the adapter's per-step row map describe one batch per forward.
- mask-mode Level 2 (SGLANG_PATHP_SCORE_RESIDENT=0) with `--dsa-topk-backend flashinfer`: the mask is applied
  around sglang's sgl-kernel and torch top-k transforms; the flashinfer transform is another function, so the
  mask would never be applied and attention would read non-resident pages.
- speculative decoding (`--speculative-algorithm`) with Path-P in copy mode: target-verify and draft forwards
  read sglang's full c4 pool outside the resident set (shrink mode is already ruled out for it).
- `--max-running-requests` above SGLANG_PATHP_DECODE_MAX_CONC: the core has that many request rows and the
  Level-2 buffers are sized once before capture; more running requests would need rows that do not exist.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flashmemory.env import FlashMemoryEnv
from flashmemory.sglang.patch_spec import StartupError


def max_running(server_args: Any) -> int:
    """sglang's --max-running-requests as resolved (DSv4 sets 256 when unset); 0 when unknown."""
    return int(getattr(server_args, "max_running_requests", None) or 0)


def rows_refusal(max_running_requests: int, env: FlashMemoryEnv) -> str | None:
    """One line when more requests may run than the core has rows, else None."""
    if max_running_requests > env.decode_max_conc:
        return (
            f"--max-running-requests {max_running_requests} exceeds SGLANG_PATHP_DECODE_MAX_CONC="
            f"{env.decode_max_conc} (the offload core's request rows, and the rows of the Level-2 buffers sized "
            "before CUDA-graph capture): set them equal, or lower --max-running-requests"
        )
    return None


def refusals(server_args: Any, env: FlashMemoryEnv, features: Sequence[str], shrink: bool) -> list[str]:
    """One line per configuration the active features cannot serve (empty: nothing to refuse). server_args None
    (not known in this process) refuses nothing."""
    if server_args is None or not features:
        return []
    out: list[str] = []
    serving = {"level2", "path_p", "level1"} & set(features)
    if serving and getattr(server_args, "enable_two_batch_overlap", False):
        out.append(
            "--enable-two-batch-overlap: FlashMemory's Level-2 buffers, side band and row map describe one "
            "batch per forward, not two micro-batches; drop the flag or turn FlashMemory off"
        )
    if "mask" in features and str(getattr(server_args, "dsa_topk_backend", "") or "") == "flashinfer":
        out.append(
            "--dsa-topk-backend flashinfer: mask-mode Level 2 (SGLANG_PATHP_SCORE_RESIDENT=0) restricts the "
            "sgl-kernel and torch top-k only, so the mask would never apply; use --dsa-topk-backend sgl-kernel "
            "or SGLANG_PATHP_SCORE_RESIDENT=1"
        )
    spec = getattr(server_args, "speculative_algorithm", None)
    if "path_p" in features and not shrink and spec:
        out.append(
            f"--speculative-algorithm {spec}: MTP target-verify and draft forwards read sglang's full c4 "
            "pool, bypassing the resident set (Path-P copy mode cannot serve them); drop speculative decoding "
            "or SGLANG_DECODE_SWAP_P"
        )
    if "path_p" in features:
        line = rows_refusal(max_running(server_args), env)
        if line:
            out.append(line)
    return out


def refuse(lines: Sequence[str]) -> None:
    """Raise StartupError naming every refusal on one line ("; " between them); nothing when `lines` is empty."""
    if lines:
        raise StartupError("; ".join(lines))
