"""The pool settings launch_decode.sh passes to sglang, from the cost model's pool arithmetic (`pools`):

- --swa-full-tokens-ratio: the smallest ratio whose SWA pool holds TGT_CONC requests of TGT_CTX tokens when the
  full pool holds them (`pools.smallest_swa_ratio`): each live request's window and one newcomer's tail + output
  reservation, instead of sglang's DeepSeek-V4 default 0.1 (a 0.1 SWA slot per full token, 3,187.5 B of the
  7,086.75 B a stock token costs). The same for stock and FlashMemory, so an A/B run stays fair.
- --mem-fraction-static with CREDIT_C4=1: sglang sizes its token pool without the c4 KV bytes, so FlashMemory's
  reserve (TGT_CONC x (KMAX + 1) recall blocks + DECODE_MAX_CONC decode regions + 1, `anchors.fm_reserve_bytes`)
  must come out of the fraction sglang announces, not out of its activation / CUDA-graph headroom: the fraction
  (given, or sglang's default formula for GPU_MIB) minus reserve / GPU bytes.

`python -m flashmemory.costmodel.launch_settings ...` prints `<ratio> <fraction or -> <reserve GiB>` on
one line; bad input is one
line on stderr naming the variable, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from flashmemory.costmodel.admission import fm_reserve_bytes
from flashmemory.costmodel.flops import FlashShape
from flashmemory.costmodel.pools import CLIP_MAX_NEW, Serving, default_mem_fraction, smallest_swa_ratio


@dataclasses.dataclass(frozen=True)
class LaunchSettings:
    """What launch_decode.sh passes: the SWA ratio and (CREDIT_C4=1) the lowered memory fraction and the reserve."""

    swa_ratio: float
    mem_fraction: float | None
    reserve_bytes: float


def window_of(model_dir: str | None) -> int:
    """The sliding window of the checkpoint at `model_dir` (config.json `window_size` / `sliding_window`), 128 when
    there is none to read (DRY_RUN with a path that does not exist)."""
    cfg = Path(model_dir or "") / "config.json"
    if not model_dir or not cfg.is_file():
        return FlashShape().window
    data = json.loads(cfg.read_text())
    return int(data.get("window_size") or data.get("sliding_window") or FlashShape().window)


def settings(
    ctx: int,
    conc: int,
    max_running: int,
    reserved: int,
    window: int = 128,
    credit_c4: bool = False,
    kmax: int = 96,
    decode_max_conc: int = 128,
    path_i: bool = False,
    gpu_mib: float | None = None,
    tp: int = 8,
    mem_fraction: float | None = None,
) -> LaunchSettings:
    """The settings for TGT_CTX `ctx` x TGT_CONC `conc`. With `credit_c4`, `gpu_mib` or `mem_fraction` is needed."""
    sv = Serving(max_running=max_running, reserved_decode_tokens=reserved)
    ratio = smallest_swa_ratio(conc, ctx, sv, CLIP_MAX_NEW, dataclasses.replace(FlashShape(), window=window))
    if not credit_c4:
        return LaunchSettings(ratio, mem_fraction, 0.0)
    if gpu_mib is None:
        raise ValueError(
            "CREDIT_C4=1 takes FlashMemory's reserve out of --mem-fraction-static, so the GPU's memory must be "
            "known: set GPU_MIB (MiB per GPU, as nvidia-smi reports it)"
        )
    reserve = fm_reserve_bytes(conc, kmax, decode_max_conc, path_i)
    base = mem_fraction if mem_fraction is not None else default_mem_fraction(gpu_mib, tp, max_running)
    frac = round(base - reserve / (gpu_mib * 2**20), 3)
    if frac <= 0.05:
        raise ValueError(
            f"CREDIT_C4=1: the reserve ({reserve / 2**30:.1f} GiB for TGT_CONC={conc}, KMAX={kmax}, "
            f"SGLANG_PATHP_DECODE_MAX_CONC={decode_max_conc}) leaves --mem-fraction-static {frac} of {base}: "
            "lower TGT_CONC or KMAX"
        )
    return LaunchSettings(ratio, frac, reserve)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashmemory.costmodel.launch_settings", description=__doc__)
    p.add_argument("--context", type=int, required=True, help="TGT_CTX: tokens per request")
    p.add_argument("--concurrency", type=int, required=True, help="TGT_CONC: requests at once")
    p.add_argument("--max-running", type=int, required=True, help="MAX_RUN: --max-running-requests")
    p.add_argument("--reserved", type=int, default=1024, help="--num-reserved-decode-tokens (default 1024)")
    p.add_argument("--model", default=None, help="MODEL: checkpoint directory (its config.json's window)")
    p.add_argument("--credit-c4", type=int, choices=(0, 1), default=0, help="CREDIT_C4")
    p.add_argument("--kmax", type=int, default=96, help="KMAX: resident pages per request")
    p.add_argument("--decode-max-conc", type=int, default=128, help="SGLANG_PATHP_DECODE_MAX_CONC")
    p.add_argument("--path-i", type=int, choices=(0, 1), default=0, help="INDEX_K_OFFLOAD")
    p.add_argument("--gpu-mib", type=float, default=None, help="GPU_MIB: memory per GPU, MiB")
    p.add_argument("--tp", type=int, default=8, help="TP")
    p.add_argument("--mem-fraction", type=float, default=None, help="MEM_FRAC: --mem-fraction-static")
    a = p.parse_args(argv)
    try:
        for name in ("context", "concurrency", "max_running", "kmax", "decode_max_conc", "tp"):
            if getattr(a, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(a, name)} must be >= 1")
        if a.gpu_mib is not None and not 0 < a.gpu_mib < 1e8:
            raise ValueError(f"GPU_MIB={a.gpu_mib:g} must lie in (0, 1e8) MiB")
        if a.mem_fraction is not None and not 0 < a.mem_fraction <= 1:
            raise ValueError(f"MEM_FRAC={a.mem_fraction:g} must lie in (0, 1]")
        s = settings(
            a.context,
            a.concurrency,
            a.max_running,
            a.reserved,
            window_of(a.model),
            bool(a.credit_c4),
            a.kmax,
            a.decode_max_conc,
            bool(a.path_i),
            a.gpu_mib,
            a.tp,
            a.mem_fraction,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    frac = "-" if s.mem_fraction is None else f"{s.mem_fraction:g}"
    print(f"{s.swa_ratio:g} {frac} {s.reserve_bytes / 2**30:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
