"""The miss monitor behind sglang, copy mode (fake DSv4 pool with sglang's page layout) and shrink mode (sglang's
real `DeepSeekV4TokenToKVPool`): the side band carries q_lora, the native query is recomputed through the indexer
module the hook saw, escalation runs inside the engine's caps, and the counters reach the Prometheus export."""

import pytest
import torch

from flashmemory.offload import check_invariants
from flashmemory.sglang.decode.adapter_factory import build
from flashmemory.sglang.decode.geometry import c4_counts
from flashmemory.sglang.decode.runtime import Runtime
from flashmemory.sglang.metrics.prometheus import DISK_KEYS, METRICS, FlashMemoryMetrics
from tests.sglang.decode.test_copy_adapter import PAGE, env, fake_pool
from tests.sglang.decode.test_shrink_adapter import c4_layer_ids, make_pool, sa  # noqa: F401 (sa is a fixture)
from tests.sglang.decode.test_shrink_adapter import env as shrink_env

pytestmark = pytest.mark.sglang
HIDDEN, RANK, HEADS = 16, 8, 4


class StubIndexer:
    """Duck-types sglang's C4Indexer.compute_weights / compute_q (whose fused kernels need a GPU): fixed linear maps."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.wp = torch.randn(HIDDEN, HEADS, generator=g)
        self.wq = torch.randn(RANK, HEADS * 128, generator=g)
        self.calls = 0

    def compute_weights(self, x, skip_scale=False):
        return x.float() @ self.wp

    def compute_q(self, q_lora, positions, weight):
        self.calls += 1
        return ((q_lora.float() @ self.wq).view(-1, HEADS, 128), None), weight


def _snap(s, g):
    return {
        "hidden_1": torch.randn(1, HIDDEN, generator=g),
        "q_lora_1": torch.randn(1, RANK, generator=g),
        "positions": s - 1,
    }


def test_copy_mode_monitor_counts_and_exports():
    prom = pytest.importorskip("prometheus_client")
    pool = fake_pool()
    eng = build(pool, env(miss_monitor=True, miss_threshold=0.0, miss_low=0.0))
    assert eng.monitor is not None and eng.cfg.max_resident_pages == 4 and eng.level1_cfg.max_resident_pages == 2
    g = torch.Generator().manual_seed(0)
    pages = [5, 2, 9, 7]
    table = torch.tensor([pages])
    seq = 3 * PAGE + 40
    for step in range(3):  # no indexer seen yet: the monitor skips, Level 1 runs as before
        s = torch.tensor([seq + 1 + step])
        eng.begin_step(["a"], table, s)
        eng.level1(_snap(s, g))
    assert eng.engine.metrics()["total"]["monitor_cycles"] == 0
    ind = StubIndexer()
    eng.indexers[1] = ind
    for step in range(3, 12):
        s = torch.tensor([seq + 1 + step])
        eng.begin_step(["a"], table, s)
        eng.level1(_snap(s, g))
    tot = eng.engine.metrics()["total"]
    assert ind.calls == tot["monitor_cycles"] > 0 and tot["miss_mass"]["n"] == tot["monitor_cycles"]
    assert 0 < tot["escalations"] <= tot["monitor_cycles"] and tot["missing_pages_added"] > 0
    assert len(eng.engine.rows[0].recall) <= eng.cfg.max_resident_pages and check_invariants(eng.engine) == []
    st = eng.stats()
    assert set(st) == set(METRICS) - set(DISK_KEYS) and st["monitor_cycles"] == tot["monitor_cycles"]
    reg = prom.CollectorRegistry()
    m = FlashMemoryMetrics.create(registry=reg)
    m.publish(st)
    m.publish(st)  # no new observations: the histogram count stays
    out = prom.generate_latest(reg).decode()
    rank = '{attn_tp_rank="0",dp_rank="0"}'  # outside sglang's process groups: rank 0 of both
    assert f"flashmemory_miss_mass_count{rank} {float(tot['monitor_cycles'])}" in out
    assert f"flashmemory_monitor_cycles_total{rank} {float(tot['monitor_cycles'])}" in out
    assert "flashmemory_escalations_total" in out and "flashmemory_budget_pages_mean" in out
    eng.begin_step([], table[:0], torch.zeros(0, dtype=torch.int64))
    eng.l1.on_step([-1], {}, torch.zeros(1, dtype=torch.long))
    assert eng.monitor.ctl.granted == 0 and eng.monitor.ctl.snapshot() == {}
    eng.close()


def test_runtime_side_band_carries_q_lora_and_the_indexer():
    rt = Runtime()
    rt.configure(env(miss_monitor=True), ("level2", "mask", "path_p", "level1"))
    ind = StubIndexer()
    x, ql = torch.randn(3, HIDDEN), torch.randn(3, RANK)
    rt.capture_sideband_input(1, x, torch.arange(3), capturing=False, q_lora=ql, indexer=ind)
    assert rt.indexers == {1: ind}
    view = rt.sideband.read(3)
    assert torch.equal(view["q_lora_1"], ql) and torch.equal(view["hidden_1"], x)
    rt2 = Runtime()
    rt2.configure(env(), ("level2", "mask", "path_p", "level1"))
    rt2.capture_sideband_input(1, x, torch.arange(3), capturing=False, q_lora=ql, indexer=ind)
    assert rt2.indexers == {} and "q_lora_1" not in rt2.sideband.read(3)  # monitor off: stock side band


def test_shrink_mode_monitor_on_sglang_pool(sa, monkeypatch):  # noqa: F811
    pool = make_pool(sa, monkeypatch, shrink=True)
    eng = build(pool, shrink_env(miss_monitor=True, miss_threshold=0.0, miss_low=0.0), sa.args, shrink=True)
    assert eng.mode == "shrink" and eng.monitor is not None and eng.cfg.max_resident_pages == 4
    eng.indexers[1] = StubIndexer()
    lay, g = eng.layout, torch.Generator().manual_seed(0)
    ix = pool.c4_indexer_kv_pool.index_k_with_scale_buffer
    pages = [9, 3, 40, 17, 22, 5]
    seq0 = 3 * PAGE + 40
    for j in range(seq0 // 4):  # PD: index-K of the target layer in sglang's device pool (finite fp8 + scale)
        loc = pages[j // 64] * 64 + j % 64
        row = torch.randint(0, 0x77, (1, 132), dtype=torch.uint8, generator=g)
        row[0, 128:] = torch.tensor([0.01]).view(torch.uint8)
        lay.index.write_chunks(ix[1], torch.tensor([loc // 64]), torch.tensor([loc % 64]), row)
    for step in range(12):
        s = torch.tensor([seq0 + 1 + step])
        _, after = (int(x) for x in c4_counts(s))
        eng.begin_step(["a"], torch.tensor([pages])[:, : -(-after // 64)], s)
        eng.settle()
        eng.level1(_snap(s, g))
    tot = eng.engine.metrics()["total"]
    assert tot["monitor_cycles"] > 0 and tot["escalations"] > 0 and check_invariants(eng.engine) == []
    assert set(eng.stats()) == set(METRICS) - set(DISK_KEYS)
    eng.begin_step([], torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    eng.close()
