"""docs/costmodel.md quotes the calibrated model: every row of its projection table and the model column of its
anchors table equal what `flashmemory bench costmodel --anchors` computes, so the page cannot drift from the model."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashmemory.costmodel.anchors import anchors, fit, glm_anchors
from flashmemory.costmodel.projections import projections

PAGE = Path(__file__).resolve().parents[2] / "docs" / "costmodel.md"
ARM = {
    "stock": "stock",
    "HiSparse": "hisparse",
    "FlashMemory, `CREDIT_C4=0`": "flashmemory-nocredit",
    "FlashMemory, `CREDIT_C4=1`": "flashmemory",
    "FlashMemory + disk tier": "disk",
}
CTX = {"128K": 131072, "256K": 262144, "1M": 1048576}


def _rows(section: str) -> list[list[str]]:
    text = PAGE.read_text().split(section, 1)[1].split("\n## ", 1)[0]
    return [
        [c.strip() for c in ln.strip("|").split("|")]
        for ln in text.splitlines()
        if ln.startswith("|") and not ln.startswith("|---")
    ][1:]


def _num(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("x").split()[0])


def test_projection_table_is_the_model() -> None:
    model = {(r["ctx"], r["arm"]): r for r in projections(fit())}
    rows = _rows("## Projected: 8xH20")
    assert len(rows) == len(model) == 15
    for ctx, arm, ratio, conc_bound, conc_01, tok, _ in rows:
        r = model[CTX[ctx], ARM[arm]]
        assert float(ratio) == r["swa_ratio"], (ctx, arm)
        assert conc_bound == f"{r['conc']} ({r['bound']})", (ctx, arm)
        assert int(conc_01) == r["conc_sglang"], (ctx, arm)
        assert _num(tok) == round(r["tok_s"]), (ctx, arm)


def test_anchor_table_is_the_model() -> None:
    """Two tables: DeepSeek-V4's anchors, then the GLM ones apart."""
    model = anchors(fit()) + glm_anchors(fit())
    rows = [r for r in _rows("## Published anchors against the model") if r[0] != "anchor"]
    assert len(rows) == len(model)
    for row, a in zip(rows, model):
        assert _num(row[3]) == pytest.approx(a.model, rel=0.006, abs=0.006), row[0]
        assert _num(row[4]) == pytest.approx(a.ratio, abs=0.006), row[0]
        assert row[5].startswith(a.use), row[0]


def test_readme_projected_rows_are_the_model() -> None:
    """The README's HiSparse table quotes the 1M row of the projection: concurrency (at the chosen SWA ratio and at
    sglang's 0.1) and tok/s per arm."""
    readme = (PAGE.parents[1] / "README.md").read_text()
    model = {r["arm"]: r for r in projections(fit()) if r["ctx"] == CTX["1M"]}
    rows = {
        ln.split("|")[1].strip(): [c.strip() for c in ln.strip().strip("|").split("|")[1:4]]
        for ln in readme.splitlines()
        if ln.startswith("| ") and "8xH20" in ln
    }
    conc = rows["max concurrent 1M-token requests, 8xH20"]
    tok = rows["decode tok/s at that concurrency, 8xH20"]
    for cell_c, cell_t, arm in zip(conc, tok, ("stock", "hisparse", "flashmemory")):
        assert _num(cell_c) == model[arm]["conc"], arm
        assert f"({model[arm]['conc_sglang']} at " in cell_c, arm
        assert _num(cell_t) == round(model[arm]["tok_s"]), arm
    assert f"; {model['flashmemory-nocredit']['conc']} at `CREDIT_C4=0`)" in conc[2]
