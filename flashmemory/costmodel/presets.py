"""Named hardware presets of the calibrated cost model (`anchors.py`): a decode side's GPUs, SMs and launch flags,
each with where its figures came from. Capacities are what the driver reports (MiB), not the marketing GB; every
preset has PCIe at 50 GB/s and one `max_running` for both the hardware bound and sglang's --max-running-requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashmemory.costmodel.pools import SGLANG_SWA_RATIO, Serving
from flashmemory.costmodel.throughput import Hardware

MIB = 2**20


@dataclass(frozen=True)
class Preset:
    """A decode side: hardware (n_gpus = decode GPUs = TP), SMs per GPU, launch flags, and where each came from."""

    name: str
    hw: Hardware
    n_sm: int
    serving: Serving
    source: str


def _node(
    name: str,
    n_gpus: int,
    hbm_mib: int,
    hbm_tbps: float,
    tflops: float,
    host_ram_gb: float,
    max_running: int,
    n_sm: int,
    source: str,
    swa_ratio: float | None = SGLANG_SWA_RATIO,
    experts: str = "fp4",
) -> Preset:
    """A preset from the driver-reported HBM (MiB), HBM bandwidth (TB/s), BF16 TFLOP/s, host RAM (GB), the
    --max-running-requests the server launches with and SMs per GPU."""
    hw = Hardware(
        n_gpus=n_gpus,
        hbm_gb=hbm_mib * MIB / 1e9,
        hbm_tbps=hbm_tbps,
        pcie_gbps=50.0,
        tflops=tflops,
        host_ram_gb=host_ram_gb,
        max_running=max_running,
        experts=experts,
    )
    return Preset(name, hw, n_sm, Serving(max_running=max_running, swa_ratio=swa_ratio), source)


H20_NODE = _node(
    "8xH20 (upstream decode)",
    n_gpus=8,
    hbm_mib=97871,
    hbm_tbps=4.0,
    tflops=148.0,
    host_ram_gb=2265.0,
    max_running=128,
    n_sm=78,
    source=(
        "H20 96 GB (97,871 MiB), 4.0 TB/s, 148 TFLOP/s BF16, 78 SMs; host 2,265 GB; decode "
        "--max-running-requests 128 (upstream launch_decode.sh); cross-machine PD: all 8 GPUs decode; SWA pool "
        "sized from the request cap (in sglang 0.5.23's ratio mode at 0.1, 47 x 256K cannot fit on this node)"
    ),
    swa_ratio=None,
)
H20_LAUNCH = _node(
    "8xH20 (launch_decode.sh)",
    n_gpus=8,
    hbm_mib=97871,
    hbm_tbps=4.0,
    tflops=148.0,
    host_ram_gb=2265.0,
    max_running=128,
    n_sm=78,
    source=(
        "this repo's launch_decode.sh on 8xH20 under sglang 0.5.23: the ds_fp8 checkpoint (FP8 routed experts), "
        "sglang's default --mem-fraction-static, --swa-full-tokens-ratio 0.1 (DeepSeek-V4 override) unless "
        "chosen, --num-reserved-decode-tokens 1024, --max-running-requests 128"
    ),
    experts="fp8",
)
B200_COLO = _node(
    "2xB200 PD-colocated",
    n_gpus=2,
    hbm_mib=183359,
    hbm_tbps=8.0,
    tflops=2250.0,
    host_ram_gb=2048.0,
    max_running=256,
    n_sm=148,
    source=(
        "B200 183,359 MiB, 8 TB/s, 2.25 PFLOP/s BF16, 148 SMs; the HiSparse paper's DeepSeek-V4-Flash runs: "
        "PD-colocated on 2xB200 (both GPUs prefill and decode, no physical PD split; TP2 assumed, the layout is "
        "not published); sglang's DSv4 max-running 256, SWA ratio 0.1"
    ),
)
RTX6000_NODE = _node(
    "8xRTX PRO 6000",
    n_gpus=8,
    hbm_mib=97887,
    hbm_tbps=1.79,
    tflops=500.0,
    host_ram_gb=1024.0,
    max_running=256,
    n_sm=188,
    source=(
        "RTX PRO 6000 Blackwell 96 GB GDDR7 (97,887 MiB), 1.79 TB/s, ~500 TFLOP/s BF16 [unverified], 188 "
        "SMs, PCIe only; sglang defaults"
    ),
)
