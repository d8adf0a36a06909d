"""The env -> core configs edge (`flashmemory.sglang.decode.core_config`): every knob lands in the typed config that
uses it, and the core's classes take no env object."""

from __future__ import annotations

import inspect

import pytest

from flashmemory.env import FlashMemoryEnv
from flashmemory.offload.engine import EngineConfig, OffloadEngine
from flashmemory.residency.escalation import EscalationConfig, EscalationController
from flashmemory.residency.level1 import Level1
from flashmemory.residency.policy import SelectionConfig, ThresholdPagePolicy
from flashmemory.sglang.decode.core_config import core_config, escalation_config
from flashmemory.sglang.decode.geometry import PoolGeometry

GEO = PoolGeometry(
    n_c4_layers=4, n_pages=50, page_chunks=64, kv_page_bytes=37440, index_head_dim=128, index_page_bytes=8448
)


def test_every_knob_reaches_its_config() -> None:
    env = FlashMemoryEnv.from_environ(
        {
            "SGLANG_RETRIEVER_SIGMOID_THRESH": "0.3",
            "SGLANG_RETRIEVER_ENSEMBLE_MODE": "mean",
            "SGLANG_RETRIEVER_PAGE_POLICY": "threshold",
            "SGLANG_RETRIEVER_LAST_KEEP": "17",
            "SGLANG_RETRIEVER_FIRST_KEEP": "5",
            "SGLANG_RETRIEVER_MAX_RESIDENT": "640",
            "SGLANG_PATHP_PAGE_KMAX": "12",
            "SGLANG_RETRIEVER_INTERVAL": "7",
            "SGLANG_PATHP_STAGGER_CYCLE": "1",
            "SGLANG_PATHP_ASYNC_RECALL": "0",
            "SGLANG_PATHP_DECODE_MAX_CONC": "3",
            "SGLANG_PATHP_RESERVE_PAGES": "40",
            "SGLANG_PATHP_DECODE_RESIDENT_CHUNKS": "100",
            "SGLANG_RETRIEVER_INLINE_LAYERS": "1,3",
            "SGLANG_PATHP_INDEX_K_OFFLOAD": "1",
        }
    )
    c = core_config(env, GEO, landing_blocks=5)
    assert (
        c.selection.threshold,
        c.selection.ensemble,
        c.selection.last_keep,
        c.selection.first_keep,
        c.selection.max_resident,
        c.selection.kmax,
        c.selection.page_cap,
        c.selection.policy,
    ) == (0.3, "mean", 17, 5, 640, 12, 10, "threshold")
    assert core_config(FlashMemoryEnv(retriever_layers=(1,)), GEO).selection.policy == "fill"  # spends KMAX
    assert c.ensemble == "mean" and c.kmax == 12 and c.escalation is None
    assert c.engine == EngineConfig(
        max_rows=3,
        max_chunks=50 * 64,
        mirror_pages=50,
        recall_blocks=40,
        decode_pages=2,
        max_resident_pages=12,
        landing_blocks=5,
    )
    assert (c.level1.tau, c.level1.stagger, c.level1.max_resident_pages, c.level1.last_keep, c.level1.async_recall) == (
        7,
        True,
        12,
        17,
        False,
    )
    assert c.layout.target_layers == (1, 3) and c.layout.offload_index_layers == (0, 2) and c.layout.n_layers == 4


def test_the_miss_monitor_widens_the_engine_cap_not_the_policy_base() -> None:
    env = FlashMemoryEnv(
        retriever_layers=(1,),
        page_kmax=6,
        miss_monitor=True,
        decode_max_conc=4,
        reserve_pages=60,
        miss_threshold=0.3,
        miss_low=0.1,
        miss_shrink_after=3,
        miss_fallback_after=5,
    )
    c = core_config(env, GEO)
    # cap 2 x KMAX; the auto pool is what the reserve holds beyond 4 rows at KMAX + 1 pages: 60 - 28
    assert c.escalation == EscalationConfig(
        threshold=0.3, low_threshold=0.1, base=6, cap=12, step=2, shrink_after=3, fallback_after=5, extra_pool=32
    )
    assert c.engine.max_resident_pages == 12 and c.selection.kmax == 12 and c.level1.max_resident_pages == 6
    # a reserve with nothing spare still lends one escalation's worth; an explicit pool wins
    assert escalation_config(FlashMemoryEnv(miss_monitor=True), 6, reserve_blocks=10, rows=4).extra_pool == 6
    assert escalation_config(FlashMemoryEnv(miss_monitor=True, miss_extra_pages=9), 6, 10, 4).extra_pool == 9


@pytest.mark.parametrize(
    "cls",
    [OffloadEngine, Level1, ThresholdPagePolicy, EscalationController, EngineConfig, SelectionConfig, EscalationConfig],
)
def test_the_core_takes_no_env(cls) -> None:
    params = inspect.signature(cls).parameters
    assert "env" not in params and not hasattr(cls, "from_env"), f"{cls.__name__} takes the env object"
