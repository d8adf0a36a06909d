"""The one place the sglang edge turns the environment into the core's typed configs.

`FlashMemoryEnv` (read by `flashmemory.env`, the only reader of the environment) stays on this side: the offload
core (`OffloadEngine`), the Level-1 policy and the escalation controller take the frozen configs built here
by `core_config(env, geo)` and never see the env object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from flashmemory.env import FlashMemoryEnv
from flashmemory.offload import EngineConfig, OffloadLayout
from flashmemory.residency.escalation import EscalationConfig
from flashmemory.residency.level1 import Level1Config
from flashmemory.residency.policy import SelectionConfig
from flashmemory.sglang.decode.geometry import PoolGeometry


@dataclass(frozen=True)
class CoreConfig:
    """The core's configs for one pool. kmax: the policy's page budget without escalation (KMAX);
    engine.max_resident_pages: the per-request cap (KMAX, or the escalation cap with the miss monitor), which
    is also the selection's kmax (Level 1 hands the policy the binding budget per request)."""

    layout: OffloadLayout
    engine: EngineConfig
    selection: SelectionConfig
    level1: Level1Config
    escalation: EscalationConfig | None  # None with the miss monitor off
    ensemble: str  # the retriever scorer's layer ensemble ("or" | "mean")
    kmax: int


def escalation_config(env: FlashMemoryEnv, base: int, reserve_blocks: int, rows: int) -> EscalationConfig:
    """The miss monitor's escalation: cap SGLANG_RETRIEVER_MISS_KMAX_CAP (0 = 2 x base); shared pool
    SGLANG_RETRIEVER_MISS_EXTRA_PAGES, or (0 = auto) what the reserve holds beyond `rows` requests at `base`
    pages each, at least one step; step = a third of the way from base to cap."""
    cap = max(base, env.miss_kmax_cap_pages(base))
    pool = env.miss_extra_pages or max(reserve_blocks - rows * (base + 1), cap - base)
    return EscalationConfig(
        threshold=env.miss_threshold,
        low_threshold=min(env.miss_low, env.miss_threshold),
        base=base,
        cap=cap,
        step=max(1, -(-(cap - base) // 3)) if cap > base else 1,
        shrink_after=env.miss_shrink_after,
        fallback_after=env.miss_fallback_after,
        extra_pool=pool,
    )


# Lockstep publish lag under tensor parallelism (Level1Config.publish_lag): a cycle submitted after decode step t
# changes the resident set after step t + 2 on every rank (the worker's scoring overlaps two decode steps; a
# later worker makes decode wait, it never makes one rank publish at another step than the others).
TP_PUBLISH_LAG = 2


def batch_group() -> Any:
    """sglang's group of the ranks that run this process's batch (a `GroupCoordinator`: its `get_dp_tp_group`, the
    attention-TP group under attention data parallelism, else the whole TP group), or None outside a server or
    before its groups exist. FlashMemory's lockstep and failure exchange span exactly this group: ranks of other
    DP groups run other requests."""
    try:
        from sglang.srt.layers.dp_attention import get_dp_tp_group

        return get_dp_tp_group()
    except (ImportError, AssertionError, AttributeError, RuntimeError, ValueError):
        return None


def serving_tp_size() -> int:
    """Ranks that run this process's batch (`batch_group`): sglang's TP world size, or its attention-TP size under
    attention DP (1 when --tp equals the DP size); 1 outside a server or before its groups exist."""
    group = batch_group()
    return int(group.world_size) if group is not None else 1


def core_config(env: FlashMemoryEnv, geo: PoolGeometry, landing_blocks: int = 0, tp_size: int = 1) -> CoreConfig:
    """All core configs for a pool of geometry `geo`. A row may grow as long as the pool lets it (max_chunks =
    the pool's c4 locs): sglang admits requests up to its --context-length, which SGLANG_DSV4_TARGET_CONTEXT
    (reserve sizing) does not bound; capping rows by it crashed the scheduler once a request outgrew it.
    landing_blocks: reserve scratch for extend stores (shrink mode). tp_size > 1: every rank runs Level 1 on
    replicated inputs, so cycles publish in lockstep (`TP_PUBLISH_LAG` decode steps after submission)."""
    pc = geo.page_chunks
    layout = OffloadLayout(
        n_layers=geo.n_c4_layers,
        page_chunks=pc,
        index_head_dim=geo.index_head_dim,
        target_layers=tuple(env.retriever_layers),
        index_offload=env.index_k_offload,
    )
    kmax = env.kmax(pc)
    cap = env.miss_kmax_cap_pages(kmax)  # KMAX, or the escalation cap with the miss monitor
    engine = EngineConfig(
        max_rows=env.decode_max_conc,
        max_chunks=geo.n_locs,
        mirror_pages=geo.n_pages,
        recall_blocks=env.auto_reserve_pages(),
        decode_pages=math.ceil(env.decode_resident_chunks / pc),
        max_resident_pages=cap,
        landing_blocks=landing_blocks,
    )
    selection = SelectionConfig(
        threshold=env.threshold,
        ensemble=env.ensemble_mode,
        last_keep=env.last_keep,
        first_keep=env.first_keep,
        max_resident=env.max_resident,
        kmax=cap,
        policy=env.page_policy,
    )
    level1 = Level1Config(
        tau=env.interval,
        stagger=env.stagger_cycle,
        max_resident_pages=kmax,
        last_keep=env.last_keep,
        async_recall=env.async_recall,
        publish_lag=min(env.interval, TP_PUBLISH_LAG) if tp_size > 1 else 0,
    )
    esc = escalation_config(env, kmax, engine.recall_blocks, engine.max_rows) if env.miss_monitor else None
    return CoreConfig(
        layout=layout,
        engine=engine,
        selection=selection,
        level1=level1,
        escalation=esc,
        ensemble=env.ensemble_mode,
        kmax=kmax,
    )
