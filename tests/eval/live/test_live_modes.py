"""`eval live`: FlashMemory's c4 mode on D (a setting of its records), `replace` of another configuration's records,
and D's gauges sampled while a document decodes (after it no request is live and they read idle values)."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from flashmemory.eval.live.arms import LiveArm
from flashmemory.eval.live.run import GaugeSampler, record_path, run_live
from flashmemory.eval.live.stack import StackSettings, pd_config
from tests.eval.live.conftest import FakeOpener, small_config
from tests.eval.live.test_run import answer_table


@pytest.mark.parametrize("mode,flag", [("copy", "0"), ("shrink", "1")])
def test_flashmemory_arm_runs_d_in_the_given_c4_mode(mode, flag):
    st = StackSettings(model=Path("m"), retriever="r.safetensors", c4_mode=mode)
    assert pd_config(LiveArm("FlashMemory", 0.1), st).decode_env["C4_SHRINK"] == flag
    assert "C4_SHRINK" not in pd_config(LiveArm("stock"), st).decode_env
    assert LiveArm("FlashMemory", 0.1).settings(4096, 512, 16, 0.5, 8, mode)["c4_mode"] == mode
    assert "c4_mode" not in LiveArm("HiSparse", 0.1).settings(4096, 512, 16, 0.5, 8, mode)


def test_replace_reruns_records_of_another_configuration(tmp_path, model_dir, retriever):
    cfg = small_config(tmp_path / "out", model_dir, retriever, arms=(LiveArm("FlashMemory", 0.1),), c4_mode="shrink")
    run_live(cfg, FakeOpener(answer_table(cfg)), log=lambda *a: None)
    path = record_path(Path(cfg.out_dir), cfg.arms[0], 8)
    old = json.loads(path.read_text())
    assert old["settings"]["c4_mode"] == "shrink"
    copy = replace(cfg, c4_mode="copy")
    with pytest.raises(Exception, match="written with another configuration"):
        run_live(copy, FakeOpener(answer_table(copy)), log=lambda *a: None)
    opener = FakeOpener(answer_table(copy))
    done = run_live(replace(copy, replace=True), opener, log=lambda *a: None)
    new = json.loads(path.read_text())
    assert new["settings"]["c4_mode"] == "copy" and new["fingerprint"] != old["fingerprint"]
    assert len(done["FlashMemory@0.1"]) == 4


def test_gauges_are_sampled_while_a_request_is_live():
    live = threading.Event()
    reads = []

    def read():
        reads.append(1)
        if len(reads) >= 3:
            live.set()
        n = 1.0 if len(reads) in (2, 3) else 0.0
        return {"flashmemory_live_requests": n, "flashmemory_resident_fraction": 0.25 * n, "x_total": 5.0}

    with GaugeSampler(read, period=0.01) as g:
        assert live.wait(5)
    assert g.means() == {"flashmemory_live_requests": 1.0, "flashmemory_resident_fraction": 0.25}
    with GaugeSampler(lambda: {"flashmemory_live_requests": 0.0}, period=0.01) as idle:
        pass
    assert idle.means() == {}


def test_report_reads_gauges_sampled_live_not_the_idle_value_after():
    from flashmemory.eval.live.report import arm_summary

    def rec(gauges):
        r = {"task_score": 1.0, "task": "mqar", "output_ids": [1, 2], "seconds": 1.0, "prompt_ids_equal": True}
        r["settings"] = {"kmax_pages": 2}
        r["metrics"] = {"flashmemory_resident_fraction": 0.0, "flashmemory_recall_bytes_total": 10.0}
        return r | ({"gauges_live": gauges} if gauges is not None else {})

    recs = {8: rec({"flashmemory_resident_fraction": 0.25}), 9: rec({"flashmemory_resident_fraction": 0.75})}
    assert arm_summary("FlashMemory@0.1", recs, {}, {}, {})["costs"]["resident_fraction"] == 0.5
    old = {8: rec(None)}  # a record from before the sampling: no value, not the idle 0
    assert arm_summary("FlashMemory@0.1", old, {}, {}, {})["costs"]["resident_fraction"] is None


def test_replay_tokens_cache_keys_on_the_replays_first_plan(tmp_path, model_dir, retriever):
    from flashmemory.eval.live.replay import ReplayTokens

    cfg = small_config(tmp_path / "out", model_dir, retriever)
    fp = {
        plan: ReplayTokens(tmp_path, retriever, (0.1,), replace(cfg, replay_first_plan=plan)).fingerprint()
        for plan in ("prompt", "full", "recency")
    }
    assert len(set(fp.values())) == 3
    assert fp["prompt"] == ReplayTokens(tmp_path, retriever, (0.1,), cfg).fingerprint()  # the published default
