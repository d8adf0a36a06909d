"""docs/grafana/flashmemory.json charts only metrics the decode server exports, charts every FlashMemory metric
family, and takes its Prometheus data source from a template variable (so it loads beside sglang's dashboards)."""

from __future__ import annotations

import copy
import json
import re

import pytest

from tests.docs.doccheck import ROOT

DASHBOARD = ROOT / "docs" / "grafana" / "flashmemory.json"
NAME_RE = re.compile(r"\bflashmemory_[a-z0-9_]+")


def exported_samples() -> set[str]:
    """Sample names a FlashMemory decode server and a HiSparse one put on /metrics, read from a real
    prometheus_client registry fed by the same code the servers run (counters as `_total`, the histogram as
    `_bucket` / `_sum` / `_count`)."""
    prom = pytest.importorskip("prometheus_client")
    from flashmemory.sglang.cpu.hisparse_record import SwapInCounter
    from flashmemory.sglang.metrics.prometheus import (
        HISPARSE_SWAPIN,
        HISPARSE_SWAPIN_PREFIX,
        PREFIX,
        FlashMemoryMetrics,
        failure_counter,
        ranked_counters,
    )

    reg = prom.CollectorRegistry()
    FlashMemoryMetrics.create(registry=reg)
    failure_counter(registry=reg).labels(hook="before_forward", dp_rank="0", attn_tp_rank="0").inc()
    assert tuple(HISPARSE_SWAPIN) == SwapInCounter.KEYS
    ranked_counters({PREFIX + HISPARSE_SWAPIN_PREFIX + k: k for k in HISPARSE_SWAPIN}, reg)  # as SwapInCounter
    from flashmemory.sglang.hisparse.state import PrefetchCounter
    from flashmemory.sglang.metrics.prometheus import HISPARSE_PREFETCH, HISPARSE_PREFETCH_PREFIX

    assert tuple(HISPARSE_PREFETCH) == PrefetchCounter.KEYS
    ranked_counters({PREFIX + HISPARSE_PREFETCH_PREFIX + k: k for k in HISPARSE_PREFETCH}, reg)  # as PrefetchCounter
    text = prom.generate_latest(reg).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def charted(dashboard: dict) -> set[str]:
    """Every flashmemory_* name in the expressions of the dashboard's panels."""
    names: set[str] = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            names |= set(NAME_RE.findall(target["expr"]))
    return names


def unknown(dashboard: dict, samples: set[str]) -> set[str]:
    return charted(dashboard) - samples


def test_every_charted_metric_is_exported() -> None:
    dash = json.loads(DASHBOARD.read_text())
    samples = exported_samples()
    assert charted(dash), "the dashboard charts nothing"
    assert not unknown(dash, samples), unknown(dash, samples)


def test_a_misspelt_metric_is_caught() -> None:
    dash = json.loads(DASHBOARD.read_text())
    bad = copy.deepcopy(dash)
    target = next(t for p in bad["panels"] for t in p.get("targets", []) if "resident_fraction" in t["expr"])
    target["expr"] = target["expr"].replace("flashmemory_resident_fraction", "flashmemory_resident_fractions")
    assert unknown(bad, exported_samples()) == {"flashmemory_resident_fractions"}


def test_every_metric_family_is_charted() -> None:
    from flashmemory.sglang.metrics.prometheus import (
        FAILURES,
        HISPARSE_PREFETCH,
        HISPARSE_PREFETCH_PREFIX,
        HISPARSE_SWAPIN,
        HISPARSE_SWAPIN_PREFIX,
        METRICS,
        PREFIX,
        SERVING_METRICS,
    )

    families = [
        *METRICS,
        *SERVING_METRICS,
        FAILURES[0],
        *(HISPARSE_SWAPIN_PREFIX + k for k in HISPARSE_SWAPIN),
        *(HISPARSE_PREFETCH_PREFIX + k for k in HISPARSE_PREFETCH),
    ]
    names = charted(json.loads(DASHBOARD.read_text()))
    missing = [f for f in families if not any(n == PREFIX + f or n.startswith(PREFIX + f + "_") for n in names)]
    assert not missing, missing


def test_the_data_source_is_a_template_variable() -> None:
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        for ds in [panel["datasource"], *(t["datasource"] for t in panel["targets"])]:
            assert ds == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
