"""Server configurations FlashMemory cannot honour, refused at start-up with one line each naming the flag.

`refusals(server_args, env, features)` is a pure function of sglang's server args (sglang 0.5.23's
`ServerArgs`, read as resolved) and the gates; `refuse` raises `StartupError` (a SystemExit: sglang's
`load_plugins`, its resolution pipeline and the scheduler's hook calls let it through, so the process stops with
the message). They run where the server args are final: at the end of their resolution in the launcher, when the
pool is attached in each scheduler process, and again before CUDA-graph capture with the model runner's own
`max_running_requests` ("Where they run" below).

What is refused and why:
- `--enable-two-batch-overlap`: each micro-batch runs its own forward over half the rows, but the Level-2
  buffers, the side band and the adapter's per-step row map describe one batch per forward.
- mask-mode Level 2 (SGLANG_PATHP_SCORE_RESIDENT=0) with `--dsa-topk-backend flashinfer`: the mask is applied
  around sglang's sgl-kernel and torch top-k transforms; the flashinfer transform is another function, so the
  mask would never be applied and attention would read non-resident pages.
- mask-mode Level 2 with Path-P and the radix cache on (no `--disable-radix-cache`): the resident mask is one per
  pool loc, but requests sharing prefix pages each hold their own resident set (score-resident mode resolves
  every pick per request and serves prefix sharing).
- speculative decoding (`--speculative-algorithm`, MTP/EAGLE) with Path-P in either mode: target-verify forwards
  carry several tokens per request and the draft model's attention reads sglang's c4 pool outside the resident
  set; neither has been run with FlashMemory.
- `--max-running-requests` above SGLANG_PATHP_DECODE_MAX_CONC: the core has that many request rows and the
  Level-2 buffers are sized once before capture; more running requests would need rows that do not exist.
- attention data parallelism (`--attn-dp-size N`, or the older `--dp N --enable-dp-attention`) on a PD decode
  server: a single server is served (each DP rank runs its own batch; Level 1's lockstep and the guard's failure
  exchange span only its attention-TP group, `core_config.batch_group`), but a decode server taking KV from P into
  DP ranks has not been run with FlashMemory.
- attention context parallelism (`--attn-cp-size`, `--enable-prefill-cp`, `--dcp-size`): one request's KV is
  split across ranks; the mirror, reserve and Level-1 plan assume one rank holds its whole c4 history.
- data-parallel replicas (`--dp N` without attention DP): each replica is a scheduler of its own with its own
  mirror, which the start-up host-memory check (one mirror per TP rank) does not count; not run with FlashMemory.
- HiCache (`--enable-hierarchical-cache`) with Path-P in either mode: it writes prefix c4 KV back into the device
  pool by pool loc, past the store hooks that fill the host mirror, so the mirror would miss that history.

Where they run: `refusals` is the one function, called twice. First in the launcher process, inside sglang's own
server-argument resolution (`resolution_step.refuse_at_resolution`, a `step` row of the hook table wrapping the
pipeline's last step): before any scheduler, data-parallel controller or tokenizer starts, so the launcher exits
with the line (sglang's data-parallel controller does not stop when its schedulers exit, so a refusal there alone
would leave the server running). Then in each scheduler process when the pool is attached
(`Runtime.check_refusals`): the second line of defence for a launcher that did not resolve the arguments itself
(an embedding `Engine` given an already resolved record, a dummy model whose resolution stops early).

Fields are read as sglang resolved them (`setting`): 0.5.23 keeps the raw input on the `ServerArgs` record and
its resolution's decisions beside it (`--dp 2 --enable-dp-attention` resolves to attn_dp_size 2, dp_size 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flashmemory.env import FlashMemoryEnv


class StartupError(SystemExit):
    """FlashMemory cannot start with the requested gates; the message says which patch or setting and why. A
    SystemExit, so it stops sglang even where `load_plugins` swallows exceptions."""

    def __init__(self, msg: str):
        super().__init__(f"FlashMemory startup error: {msg}")


def setting(server_args: Any, name: str, default: Any = None) -> Any:
    """Field `name` of sglang's server args as resolved: sglang's `resolution_result` on a resolved `ServerArgs`
    record (its declarations, then the raw input), else the plain attribute (a record not resolved yet, a stand-in
    namespace)."""
    if getattr(server_args, "_resolved_overrides", None):
        try:
            from sglang.srt.arg_groups.overrides import resolution_result

            return resolution_result(server_args, name, default)
        except (ImportError, AttributeError, TypeError):
            pass
    return getattr(server_args, name, default)


def _int(server_args: Any, name: str) -> int:
    return int(setting(server_args, name, 1) or 1)


def layout_refusals(server_args: Any) -> list[str]:
    """One line per sglang parallel layout FlashMemory does not serve: attention DP on a PD decode server, attention
    CP (prefill, decode or explicit), data-parallel replicas. Plain TP (any `--tp`), attention DP on a single server
    and PD disaggregation pass."""
    out: list[str] = []
    tp = _int(server_args, "tp_size")
    attn_dp = _int(server_args, "attn_dp_size")
    dp = _int(server_args, "dp_size")
    if attn_dp <= 1 and bool(getattr(server_args, "enable_dp_attention", False)) and dp > 1:
        attn_dp, dp = dp, 1  # a record not resolved yet: the deprecated spelling
    if attn_dp > 1 and str(setting(server_args, "disaggregation_mode", "null") or "null") == "decode":
        out.append(
            f"--attn-dp-size {attn_dp} (or --dp {attn_dp} --enable-dp-attention) with --disaggregation-mode decode: "
            "FlashMemory serves attention data parallelism on a single server, but a PD decode server taking KV "
            f"into DP ranks has not been run with it; serve D with plain --tp {tp} (no attention DP) or turn "
            "FlashMemory off"
        )
    cp = _int(server_args, "attn_cp_size")
    dcp = _int(server_args, "dcp_size")
    if cp > 1 or dcp > 1 or bool(setting(server_args, "enable_prefill_cp", False)):
        flags = " ".join(
            f
            for f, on in (
                (f"--attn-cp-size {cp}", cp > 1),
                ("--enable-prefill-cp", bool(setting(server_args, "enable_prefill_cp", False))),
                (f"--dcp-size {dcp}", dcp > 1),
            )
            if on
        )
        out.append(
            f"{flags}: context parallelism splits one request's KV across ranks, but FlashMemory's host mirror, "
            "reserve and Level-1 plan hold a request's whole c4 history on one rank; drop context parallelism "
            "(plain --tp) or turn FlashMemory off"
        )
    if dp > 1 and attn_dp <= 1:
        out.append(
            f"--dp {dp}: data-parallel replicas each build their own FlashMemory host mirror, which the start-up "
            "host-memory check (one mirror per TP rank) does not count, and they are not run with FlashMemory; "
            "start one server per replica behind sglang's router, or turn FlashMemory off"
        )
    return out


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


def refusals(server_args: Any, env: FlashMemoryEnv, features: Sequence[str]) -> list[str]:
    """One line per configuration the active features cannot serve (empty: nothing to refuse; every refusal holds
    for both Path-P modes). server_args None (not known in this process) or no feature (gates off: stock sglang)
    refuses nothing."""
    if server_args is None or not features:
        return []
    out: list[str] = []
    serving = {"level2", "path_p", "level1"} & set(features)
    if serving and setting(server_args, "enable_two_batch_overlap", False):
        out.append(
            "--enable-two-batch-overlap: FlashMemory's Level-2 buffers, side band and row map describe one "
            "batch per forward, not two micro-batches; drop the flag or turn FlashMemory off"
        )
    if "mask" in features and str(setting(server_args, "dsa_topk_backend", "") or "") == "flashinfer":
        out.append(
            "--dsa-topk-backend flashinfer: mask-mode Level 2 (SGLANG_PATHP_SCORE_RESIDENT=0) restricts the "
            "sgl-kernel and torch top-k only, so the mask would never apply; use --dsa-topk-backend sgl-kernel "
            "or SGLANG_PATHP_SCORE_RESIDENT=1"
        )
    if "mask" in features and "path_p" in features and radix_cache_on(server_args):
        out.append(
            "--disable-radix-cache is not set: with mask-mode Level 2 (SGLANG_PATHP_SCORE_RESIDENT=0) the resident "
            "mask is one per pool loc, so requests sharing prefix pages through the radix cache would be masked by "
            "each other's resident sets; pass --disable-radix-cache or use SGLANG_PATHP_SCORE_RESIDENT=1"
        )
    spec = setting(server_args, "speculative_algorithm", None)
    if "path_p" in features and spec:
        out.append(
            f"--speculative-algorithm {spec}: MTP target-verify forwards carry several tokens per request and the "
            "draft model's attention reads sglang's c4 pool outside the resident set; FlashMemory serves neither "
            "Path-P mode (copy or shrink) with speculative decoding: drop it or set SGLANG_DECODE_SWAP_P=0"
        )
    if "path_p" in features and bool(setting(server_args, "enable_hierarchical_cache", False)):
        out.append(
            "--enable-hierarchical-cache: HiCache writes prefix c4 KV back into the device pool by pool loc, past "
            "the store hooks that fill FlashMemory's host mirror, so the mirror would miss that history (copy and "
            "shrink mode alike); drop HiCache or set SGLANG_DECODE_SWAP_P=0"
        )
    if serving:
        out.extend(layout_refusals(server_args))
    if "path_p" in features:
        line = rows_refusal(max_running(server_args), env)
        if line:
            out.append(line)
    return out


def radix_cache_on(server_args: Any) -> bool:
    """Whether sglang's radix cache shares prefix pages between running requests on this server (on unless
    --disable-radix-cache; a PD decode server drops it unless --disaggregation-decode-enable-radix-cache). Args
    without the field (a stand-in record) say nothing: False."""
    if setting(server_args, "disable_radix_cache", True):
        return False
    if str(setting(server_args, "disaggregation_mode", "null") or "null") == "decode":
        return bool(setting(server_args, "disaggregation_decode_enable_radix_cache", False))
    return True


def refuse(lines: Sequence[str]) -> None:
    """Raise StartupError naming every refusal on one line ("; " between them); nothing when `lines` is empty."""
    if lines:
        raise StartupError("; ".join(lines))
