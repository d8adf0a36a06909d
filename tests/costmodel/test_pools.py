"""The pool sizing of `flashmemory.costmodel.pools` against sglang 0.5.23's own `DSV4PoolConfigurator` and
memory-fraction default on the installed package, with the DeepSeek-V4-Flash geometry, so the model cannot drift
from the server it models. sglang's configurator is built without a server (its `__init__` reads the global
server args): the attributes its `__init__` would derive are set from the same geometry, and the runtime-context
getters it calls are replaced by namespaces holding the launch flags."""

from __future__ import annotations

import types

import pytest

from flashmemory.costmodel.flops import FlashShape
from flashmemory.costmodel.pools import (
    Serving,
    admitted,
    bytes_per_full_token,
    bytes_per_swa_slot,
    default_mem_fraction,
    fixed_bytes,
    kv_bytes_per_full_token,
    padded_bytes_per_token,
    pool_sizes,
    smallest_swa_ratio,
    swa_need,
    swa_tail,
)

pc = pytest.importorskip("sglang.srt.model_executor.pool_configurator")
v4pool = pytest.importorskip("sglang.srt.mem_cache.deepseek_v4_memory_pool")
S = FlashShape()
RATIOS = [0, 0] + [4, 128] * 20 + [4]  # DeepSeek-V4-Flash config.json compress_ratios


def _configurator(monkeypatch: pytest.MonkeyPatch, sv: Serving) -> object:
    """A DSV4PoolConfigurator for a PD decode server launched with `sv`, bypassing its server-args __init__."""
    ns = types.SimpleNamespace
    exec_bag = lambda: ns(kernel=ns(dsv4_attn_backend="flashmla"))  # noqa: E731
    monkeypatch.setattr(pc, "get_exec", exec_bag)
    monkeypatch.setattr(v4pool, "get_exec", exec_bag)
    monkeypatch.setattr(pc, "get_spec", lambda: ns(speculative_algorithm=None, speculative_num_draft_tokens=None))
    monkeypatch.setattr(
        pc,
        "get_schedule",
        lambda: ns(
            max_running_requests=sv.max_running,
            swa_prefix_tails=None,
            _swa_full_tokens_ratio_explicitly_set=sv.swa_ratio is not None,
            swa_full_tokens_ratio=sv.swa_ratio,
            chunked_prefill_size=8192,
            disable_overlap_schedule=False,
        ),
    )
    monkeypatch.setattr(
        pc,
        "get_disagg",
        lambda: ns(disaggregation_mode="decode", disaggregation_decode_extra_slots=sv.decode_extra_slots),
    )
    monkeypatch.setattr(pc, "get_memory", lambda: ns(disable_radix_cache=not sv.radix_cache))
    c = object.__new__(pc.DSV4PoolConfigurator)
    owners = {r: [i for i, x in enumerate(RATIOS) if x == r] for r in (4, 128)}
    c.__dict__.update(
        kv_cache_dtype_str="fp8_e4m3",
        qk_nope_head_dim=448,
        qk_rope_head_dim=64,
        indexer_head_dim=128,
        attn_head_dim=512,
        _unified=False,
        _unified_fp8=False,
        kv_bytes=448 + 64 * 2 + 8,
        indexer_bytes_per_token=v4pool.get_dsv4_indexer_bytes_per_token(128, False),
        context_len=1048576,
        stage_compress_ratios=RATIOS,
        stage_owner_layers=owners,
        operator_swa_ratio=pc._operator_swa_full_tokens_ratio(),
        swa_ratio=sv.swa_ratio if sv.swa_ratio is not None else pc.DSV4_DEFAULT_SWA_FULL_TOKENS_RATIO,
        sliding_window_size=S.window,
        page_size=256,
        is_speculative=False,
        online_c128_mtp_max_draft_tokens=0,
        attn_dp_size=sv.dp,
        requested_max_running_requests_per_worker=max(1, sv.max_running // sv.dp),
        disaggregation_mode="decode",
        disaggregation_decode_extra_slots=sv.decode_extra_slots,
        c4_shrink_factor=sv.hisparse_ratio,
        ring_sizes={r: v4pool.get_compress_state_ring_size(r, 0) for r in (4, 128)},
        num_layers_total=len(RATIOS),
        low_ratio_index_bytes=v4pool.get_dsv4_indexer_bytes_per_token(128, True),
        _swa_ring_size=S.window,
        _spec_infl=1.0,
        encoder_replay=False,
        paged_draft_layers=0,
        request_window_bytes=0,
    )
    c.swa_prefix_tails = c._resolve_swa_prefix_tails()
    c.swa_cap_tokens = c._resolve_swa_cap_tokens()
    c.bytes_per_swa_token = c._get_bytes_per_swa_token()
    c.bytes_per_full_token = c._get_bytes_per_full_token()
    return c


SERVINGS = [
    Serving(),  # ratio mode at sglang's DeepSeek-V4 default 0.1
    Serving(hisparse_ratio=2),
    Serving(hisparse_ratio=10, swa_ratio=0.004),
    Serving(max_running=128, swa_ratio=0.00083),
    Serving(max_running=128, swa_ratio=None),  # cap mode
    Serving(max_running=128, swa_ratio=None, dp=8),
    Serving(max_running=64, radix_cache=True, decode_extra_slots=3, swa_ratio=None),
]


def _id(s: Serving) -> str:
    return f"R{s.max_running}-h{s.hisparse_ratio}-rx{s.radix_cache}-swa{s.swa_ratio}-dp{s.dp}"


@pytest.mark.parametrize("sv", SERVINGS, ids=_id)
def test_bytes_and_fixed_match_sglang(monkeypatch: pytest.MonkeyPatch, sv: Serving) -> None:
    c = _configurator(monkeypatch, sv)
    assert c.bytes_per_full_token == pytest.approx(bytes_per_full_token(sv))
    assert c.bytes_per_swa_token == pytest.approx(bytes_per_swa_slot())
    sg_fixed = c._get_c128_state_fixed_bytes(sv.running_per_rank) + c._get_swa_fixed_bytes()
    assert sg_fixed == pytest.approx(fixed_bytes(sv))
    for ratio in (0, 4, 128):
        assert c._get_paged_kv_bytes_per_token(ratio) == pytest.approx(padded_bytes_per_token(ratio))


@pytest.mark.parametrize("sv", SERVINGS[:6], ids=_id)
@pytest.mark.parametrize("avail_gb", [20.0, 72.4])
def test_pool_sizes_match_sglang(monkeypatch: pytest.MonkeyPatch, sv: Serving, avail_gb: float) -> None:
    c = _configurator(monkeypatch, sv)
    cfg = c.calculate_pool_sizes(int(avail_gb * 1e9), 256)
    # weights 0 and mem_fraction 1: `available` is exactly the bytes handed to sglang
    ours = pool_sizes(int(avail_gb * 1e9), 0.0, 8, Serving(**{**sv.__dict__, "mem_fraction": 1.0}))
    assert ours.full_tokens == cfg.full_max_total_num_tokens
    assert ours.swa_tokens == cfg.swa_max_total_num_tokens
    assert ours.c4_device_slots == cfg.c4_max_total_num_tokens


def test_figures_by_hand() -> None:
    # 21 c4 layers x (585/4 + 132/4) + 20 c128 layers x 864/128; HiSparse ratio 2 halves only the c4 KV term
    assert kv_bytes_per_full_token(Serving()) == 21 * (585 / 4 + 33) + 20 * 864 / 128 == 3899.25
    assert kv_bytes_per_full_token(Serving(hisparse_ratio=2)) == 21 * (585 / 8 + 33) + 135 == 2363.625
    assert kv_bytes_per_full_token(Serving(credit_c4=True)) == 21 * 33 + 135 == 828.0
    # ratio mode (sglang's DSv4 default 0.1): each full token also buys 0.1 SWA slot of 43 x 585 + 21 x 320
    assert bytes_per_full_token(Serving()) == 3899.25 + 0.1 * (43 * 585 + 21 * 8 / 256 * 10240) == 7086.75
    assert bytes_per_full_token(Serving(swa_ratio=None)) == 3899.25  # cap mode: SWA is a fixed pool


def test_pd_decode_admission_counts_reserved_tokens_and_the_swa_pool() -> None:
    from flashmemory.costmodel.pools import PoolSizes

    sv = Serving(max_running=64, reserved_decode_tokens=1024)
    # a 1M request holds 4,096 pages plus 1,024 reserved tokens in the full pool
    pools = PoolSizes(0.9, 0.0, 0.0, 10 * (1048576 + 1024), 10**9, 0)
    assert admitted(pools, 1048576, sv) == (10, "token pool")
    assert admitted(PoolSizes(0.9, 0.0, 0.0, 10 * 1048576, 10**9, 0), 1048576, sv)[0] == 9
    # SWA: the tail from the page of position ctx - 128 (page-aligned: 256 or 512) + min(max_new, 4096) for the
    # newcomer, 768 for each request already decoding
    assert swa_tail(1048576, 128) == 256 and swa_tail(1000, 128) == 1000 - 768
    assert swa_need(1, 1048576, 8192) == 256 + 4096 and swa_need(5, 1048576, 100) == 4 * 768 + 768
    few = PoolSizes(0.9, 0.0, 0.0, 10**9, 4 * 768 + 4352, 0)
    assert admitted(few, 1048576, sv) == (5, "SWA pool")
    assert admitted(PoolSizes(0.9, 0.0, 0.0, 10**9, 4351, 0), 1048576, sv) == (0, "SWA pool")


def test_smallest_swa_ratio_holds_what_the_full_pool_admits() -> None:
    sv = Serving(max_running=128)
    for n, ctx in ((12, 1048576), (64, 262144), (4, 4096)):
        r = smallest_swa_ratio(n, ctx, sv)
        full = n * (ctx + 1024)
        sizes = _sizes(full, r)
        assert admitted(sizes, ctx, Serving(max_running=128, swa_ratio=r))[0] == n
        smaller = _sizes(full, r * 0.9)
        assert admitted(smaller, ctx, Serving(max_running=128, swa_ratio=r))[0] < n


def _sizes(full: int, ratio: float) -> object:
    from flashmemory.costmodel.pools import PAGE, PoolSizes

    return PoolSizes(0.9, 0.0, 0.0, full, int(full * ratio) // PAGE * PAGE, 0)


def test_default_mem_fraction_matches_sglang_formula() -> None:
    hook = pytest.importorskip("sglang.srt.arg_groups.memory_hook")
    src = open(hook.__file__).read()
    # the constants this function restates, read from the installed source
    for needle in (
        "reserved_mem = 512",
        "activation_tokens * 1.5",
        "cfg.tp_size * cfg.pp_size / 8 * 1024",
        "reserved_mem = max(reserved_mem, 10 * 1024)",
        "decode_cuda_graph_config.max_bs * 2",
        "round((gpu_mem - reserved_mem) / gpu_mem, 3)",
    ):
        assert needle in src, needle
    assert default_mem_fraction(97871, 8, 128) == round((97871 - 10240) / 97871, 3) == 0.895
    assert default_mem_fraction(40000, 1, 4096) == round((40000 - (512 + 1.5 * 4096 + 128 + 320)) / 40000, 3)
