"""The calibrated cost model against the published figures: each fitted constant reproduces the one anchor it was
fitted on, every held-out anchor lands within +-20% or carries the reason the model cannot reach it, HiSparse's
small-batch ratio stays <= 1 and rises with the batch as measured, HiSparse's 1M concurrency follows sglang's
token-pool sizing with host_to_device_ratio, and `bench costmodel --anchors` prints and writes the same numbers."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flashmemory.cli import main
from flashmemory.costmodel.admission import capacity, fm_admitted, fm_reserve_bytes, sized, tok_s
from flashmemory.costmodel.anchors import (
    TOLERANCE,
    anchors,
    calibrated,
    calibrated_hisparse,
    fit,
    glm_anchors,
    launch_node,
)
from flashmemory.costmodel.hisparse import HiSparseKnobs, swap_kernel_ms
from flashmemory.costmodel.pools import Serving, bytes_per_full_token
from flashmemory.costmodel.presets import B200_COLO, H20_NODE, RTX6000_NODE
from flashmemory.costmodel.projections import projections

F = fit()
M1 = 1048576
# Held-out anchors the model does not reach, each for a stated reason (the paper's and the PR's stock launches)
OUTSIDE = {
    "HiSparse decode-only tok/s at 64 running",
    "decode-only HiSparse / stock, 64 vs ~23 running",
    "stock requests decoding at once",
    "generation HiSparse / stock",
    "stock generation tok/s",
}


def test_each_constant_reproduces_the_anchor_it_was_fitted_on() -> None:
    up = calibrated(H20_NODE, F, fitted_memory=True)
    assert capacity(up, "stock", 262144)[0] == 47
    assert tok_s(up, "stock", 262144, 47) == pytest.approx(1584.0)
    assert capacity(up, "flashmemory", M1, 96) == (40, "host DRAM")
    assert F.swap_layer_us * 21 == pytest.approx(7500.0)
    assert 0 < F.mem_fraction < 1 and 0 < F.host_fraction < 1 and F.overhead_ms > 0
    # each preset its own step overhead: the 2xB200 colocated server's from the paper's stock decode-only figure
    b2 = calibrated(B200_COLO, F)
    assert tok_s(b2, "stock", 32768 + 4096, 23) == pytest.approx(1511.0)
    assert 0 < F.overhead_b200_ms < 15.2 and b2.hw.overhead_ms == F.overhead_b200_ms
    assert calibrated(RTX6000_NODE, F).hw.overhead_ms == F.overhead_ms  # GLM's node: no figure of its own
    for p in (B200_COLO, RTX6000_NODE):
        assert calibrated(p, F).serving.mem_fraction is None  # sglang's own default, not the 8xH20 fit


def test_held_out_anchors_within_tolerance_or_explained() -> None:
    table = anchors(F)
    fits = [a.name for a in table if a.use == "fit"]
    assert fits == [
        "stock concurrency 256K",
        "stock tok/s 256K @ 47",
        "FlashMemory 1M ceiling KMAX 96",
        "stock decode-only tok/s at ~23 running",
    ]
    assert all(a.family == "DeepSeek-V4" for a in table)  # the table holds DeepSeek-V4's figures only
    outside = {a.name for a in table if a.use == "held out" and abs(a.ratio - 1) > TOLERANCE}
    assert outside == OUTSIDE
    assert all(a.lacks for a in table if a.name in outside)
    upstream = [a for a in table if a.setting == H20_NODE.name and a.use == "held out"]
    assert len(upstream) == 9 and all(abs(a.ratio - 1) <= TOLERANCE for a in upstream)
    ratio = next(a for a in table if a.name.startswith("FlashMemory / stock tok/s at 1M"))
    assert ratio.published == 2.8 and abs(ratio.ratio - 1) <= 0.10
    # the one held-out anchor whose step the fitted overhead does not dominate: HiSparse at 64 on 2xB200, where
    # the swap-in kernel is 7.5 of 26.6 ms and the overhead 10.7; it misses, and says which setting is missing
    hs64 = next(a for a in table if a.name == "HiSparse decode-only tok/s at 64 running")
    step = 64 / hs64.model * 1e3
    assert F.overhead_b200_ms / step < 0.5 and "hit rate and hot-buffer size" in hs64.lacks
    glm = glm_anchors(F)
    assert {a.family for a in glm} == {"GLM"} and all(a.use == "apart" for a in glm)
    mem = next(a for a in glm if a.name.startswith("HBM per 128K request"))
    # GLM-5.1's figure; DeepSeek-V4-Flash's c4 KV of 32,768 entries vs a 1,024 + 64 slot hot buffer as a stand-in
    assert mem.model == pytest.approx(32768 / 1088) and "GLM-5.1" in mem.source


def test_small_batch_hisparse_ratio_below_one_and_rising() -> None:
    rows = [a for a in glm_anchors(F) if a.name.startswith("HiSparse / stock at batch")]
    assert all("GLM DSA" in a.source for a in rows)
    assert [a.published for a in rows] == [0.92, 0.92, 1.19, 2.43, 3.00]
    ratios = [a.model for a in rows]
    assert all(r <= 1 for r in ratios) and ratios == sorted(ratios)
    assert abs(rows[0].ratio - 1) <= TOLERANCE
    # without the swap-in kernel the small-batch ratio would be ~1: the kernel is what the model adds
    p = calibrated(RTX6000_NODE, F)
    bare = tok_s(p, "hisparse", 33792, 1, hs=HiSparseKnobs()) / tok_s(p, "stock", 33792, 1)
    assert bare > 0.97 > ratios[0]


def test_swap_kernel_by_hand() -> None:
    hs = HiSparseKnobs(swap_layer_us=100.0)
    assert swap_kernel_ms(1, 32768, hs, 78) == pytest.approx(21 * 0.1)
    assert swap_kernel_ms(79, 32768, hs, 78) == pytest.approx(2 * 21 * 0.1)  # a second wave of blocks
    assert swap_kernel_ms(8, 16384, hs, 78) == 0.0  # 4,096 entries fit the buffer: the kernel's fast path
    with pytest.raises(ValueError, match="host_to_device_ratio"):
        HiSparseKnobs(host_to_device_ratio=0)


def test_hisparse_1m_concurrency_follows_sglang_token_pool() -> None:
    p = launch_node(F)  # this repo's launch at sglang's SWA ratio 0.1, FP8 experts, sglang's memory fraction
    hs = calibrated_hisparse(F)
    pools = sized(p, dataclasses.replace(p.serving, hisparse_ratio=2))
    # every request reserves its whole context + 1,024 decode tokens in logical tokens at 2,363.625 B of c4/c128
    # plus 0.1 x 31,875 B of SWA each
    assert bytes_per_full_token(Serving(hisparse_ratio=2)) == 2363.625 + 3187.5
    assert pools.mem_fraction == 0.895
    assert capacity(p, "hisparse", M1, hs=hs) == (pools.full_tokens // (M1 + 1024), "token pool") == (9, "token pool")
    stock = capacity(p, "stock", M1)[0]
    assert stock == sized(p).full_tokens // (M1 + 1024) == 7
    more = capacity(p, "hisparse", M1, hs=dataclasses.replace(hs, host_to_device_ratio=10))[0]
    same = capacity(p, "hisparse", M1, hs=dataclasses.replace(hs, host_to_device_ratio=1))[0]
    assert same == stock < 9 < more


def test_projection_rows_by_hand() -> None:
    rows = {(r["ctx"], r["arm"]): r for r in projections(F)}
    p = launch_node(F)
    # at sglang's ratio 0.1 (the launch without SWA_RATIO): 7 / 9 / 11 at 1M
    assert [rows[M1, a]["conc_sglang"] for a in ("stock", "hisparse", "flashmemory")] == [7, 9, 11]
    # at the smallest ratio for what each arm admits: 13 / 21 / 40
    assert rows[M1, "stock"]["conc"] == 13 and rows[M1, "hisparse"]["conc"] == 21
    assert rows[M1, "flashmemory"]["bound"] == "host DRAM" and rows[M1, "flashmemory"]["conc"] == 40
    assert rows[M1, "disk"]["conc"] >= rows[M1, "flashmemory"]["conc"]
    for (ctx, arm), r in rows.items():  # the chosen ratio's SWA pool holds what the full pool admits
        sv = dataclasses.replace(p.serving, swa_ratio=r["swa_ratio"])
        assert capacity(dataclasses.replace(p, serving=sv), arm, ctx, r["kmax"])[0] == r["conc"], (ctx, arm)
        assert r["bound"] != "SWA pool", (ctx, arm)
    # launched without CREDIT_C4, FlashMemory's token pool is stock's: it admits what stock admits
    for ctx in (131072, 262144, M1):
        assert rows[ctx, "flashmemory-nocredit"]["conc"] == rows[ctx, "stock"]["conc"]
    assert rows[131072, "flashmemory"] == {
        "ctx": 131072,
        "arm": "flashmemory",
        "kmax": 48,
        "conc": 128,
        "bound": "max-running",
        "tok_s": pytest.approx(tok_s(p, "flashmemory", 131072, 128, 48)),
        "swa_ratio": 0.00605,
        "conc_sglang": 94,
    }


def test_reserve_comes_off_the_memory_fraction() -> None:
    """CREDIT_C4=1: the reserve the plugin sizes for TGT_CONC (KMAX + 1 blocks each, 8 per decode row, 1 sink) is
    taken off --mem-fraction-static, so admitting more requests shrinks the pool that admits them."""
    assert fm_reserve_bytes(60, 96) == (60 * 97 + 128 * 8 + 1) * 21 * 37440 == 5_381_812_800
    assert fm_reserve_bytes(40, 384, path_i=True) == (40 * 385 + 1025) * (21 * 37440 + 18 * 8448)
    p = launch_node(F)
    n, bound, sv = fm_admitted(p, M1, 384)
    assert sv.reserve_bytes == fm_reserve_bytes(n, 384, 128, True) and sv.credit_c4
    assert sized(p, sv).mem_fraction == pytest.approx(0.895 - sv.reserve_bytes / (p.hw.hbm_gb * 1e9))
    assert n == 11 and bound == "token pool"
    more = dataclasses.replace(sv, reserve_bytes=fm_reserve_bytes(n + 1, 384, 128, True))
    assert _capacity_of(p, more) < n + 1


def _capacity_of(p: object, sv: Serving) -> int:
    from flashmemory.costmodel.pools import admitted

    return admitted(sized(p, sv), M1, sv)[0]


def test_bench_anchors_prints_and_writes(tmp_path, capsys) -> None:
    out = tmp_path / "a.json"
    assert main(["bench", "costmodel", "--anchors", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "FITTED CONSTANTS" in text and "ANCHORS (DeepSeek-V4): published figure vs the calibrated model" in text
    assert "APART, NOT DeepSeek-V4 (GLM" in text and "  Sources:" in text and "sglang PR #33075" in text
    assert "PROJECTED (calibrated model, not measured)" in text and "Per-decode-token GFLOP" not in text
    d = json.loads(out.read_text())
    assert set(d) == {"anchors", "projections"} and len(d["projections"]) == 15
    assert {a["name"] for a in d["anchors"]["anchors"] if not a["within"]} == OUTSIDE
    with pytest.raises(SystemExit) as e:  # a count flag: argparse's own line, before any work
        main(["bench", "costmodel", "--anchors", "--hisparse-ratio", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("flashmemory bench costmodel: error: argument --hisparse-ratio")
