"""Live on CPU: `flashmemory eval live`'s whole path on one small arm. FlashMemory at half the pages on the serving
model (random weights: the scores say nothing), two 256-token documents through P + D + router with the OpenAI
client: each gets a record with its 4 output ids, D's counters and a task score; the report is written; a rerun
starts no stack (both documents are done); no server is left. The lock is a file of the test's own, so the test
also runs inside `flock` on the shared one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.sglang]
pytest.importorskip("sglang")
pytest.importorskip("nixl._api", reason="PD on CPU moves KV with NIXL: pip install -e '.[serve-nixl]'")

from flashmemory.eval.live.arms import LiveArm  # noqa: E402
from flashmemory.eval.live.run import LiveConfig, record_path, run_live  # noqa: E402
from flashmemory.eval.live.stack import StackSettings, open_session  # noqa: E402
from tests.sglang.live.conftest import STARTUP_S  # noqa: E402


def test_one_arm_two_documents_records_report_and_resume(serving_model, tiny_retriever_ckpt, tmp_path):
    arm = LiveArm("FlashMemory", 0.5)
    cfg = LiveConfig(
        out_dir=str(tmp_path / "out"),
        model=str(serving_model),
        arms=(arm,),
        retriever=tiny_retriever_ckpt,
        n_per_task=2,
        tasks=("niah_single",),
        doc_len=256,
        gen_tokens=4,
        tau=2,
        lock=str(tmp_path / "live.lock"),
        budgets=(0.5,),
    )
    st = StackSettings(
        model=Path(serving_model),
        retriever=tiny_retriever_ckpt,
        context_len=cfg.context_len(),
        doc_len=cfg.doc_len,
        index_topk=json.loads((Path(serving_model) / "config.json").read_text()).get("index_topk", 512),
        tau=cfg.tau,
        startup_timeout=STARTUP_S,
        logs=tmp_path / "logs",
    )
    sessions = []

    def opener(a):
        sessions.append(open_session(a, st, cfg.lock))
        return sessions[-1]

    done = run_live(cfg, opener)
    assert sorted(done[arm.key]) == [8, 9] and len(sessions) == 1
    for i in (8, 9):
        rec = json.loads(record_path(tmp_path / "out", arm, i).read_text())
        assert len(rec["output_ids"]) == 4 and 0.0 <= rec["task_score"] <= 1.0
        assert rec["settings"]["kmax_pages"] == 1 and "flashmemory_recall_bytes_total" in rec["metrics"]
        assert rec["metrics"]["flashmemory_live_requests"] == 0  # read once D had let the request go
    assert "| FlashMemory@0.5 | 2 |" in (tmp_path / "out" / "live.md").read_text()
    assert not sessions[0].servers.leftovers()
    assert run_live(cfg, opener)[arm.key].keys() == {8, 9} and len(sessions) == 1  # resumed: nothing started
