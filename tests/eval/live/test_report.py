"""`eval.live.report` and `eval.live.replay`: live beside replay on the same documents, agreement, tokens equal to
stock and to the replay, the first differing token, counted costs."""

from __future__ import annotations

import json

import pytest

from flashmemory.errors import UserError
from flashmemory.eval.live.arms import LiveArm
from flashmemory.eval.live.replay import first_difference, replay_rows, setting_differences
from flashmemory.eval.live.report import aggregate, markdown
from tests.eval.live.conftest import small_config

STOCK, FM = LiveArm("stock"), LiveArm("FlashMemory", 0.1)


def rec(arm, i, task, score, ids, recall=0.0):
    return {
        "arm": arm.key,
        "index": i,
        "task": task,
        "task_score": score,
        "output_ids": ids,
        "text": "x",
        "seconds": 10.0,
        "prompt_ids_equal": True,
        "settings": {"kind": arm.kind},
        "metrics": {"flashmemory_recall_bytes_total": recall, "flashmemory_resident_fraction": 0.1},
    }


def write_replay(root, rows: dict[int, tuple[float, float]]):
    """A replay frontier dir: document i with Full and FlashMemory task scores at budget 0.1 (and 0.2)."""
    (root / "docs").mkdir(parents=True)
    for i, (full, fm) in rows.items():
        b = {"Full": {"task_score": full}, "FlashMemory": {"task_score": fm}, "HiSparse": {"task_score": full}}
        body = {"format": "flashmemory-frontier/1", "index": i, "budgets": {"0.1": b, "0.2": b}}
        (root / "docs" / f"{i:05d}.json").write_text(json.dumps(body))
    (root / "frontier.json").write_text(json.dumps({"config": {"doc_len": 4096, "gen_tokens": 24, "tau": 16}}))


def test_replay_rows_pick_the_same_method_and_budget(tmp_path):
    write_replay(tmp_path / "r", {8: (1.0, 0.5), 9: (0.0, 0.0)})
    rows = replay_rows(str(tmp_path / "r"), (STOCK, FM, LiveArm("HiSparse", 0.2)), [8, 9, 10])
    assert rows["stock"][8]["task_score"] == 1.0 and rows["FlashMemory@0.1"][8]["task_score"] == 0.5
    assert rows["HiSparse@0.2"][9]["task_score"] == 0.0 and 10 not in rows["stock"]
    with pytest.raises(UserError, match="--replay .*no replay frontier run there"):
        replay_rows(str(tmp_path / "missing"), (STOCK,), [8])


def test_aggregate_agreement_tokens_and_first_difference(tmp_path, model_dir, retriever):
    cfg = small_config(tmp_path / "out", model_dir, retriever, arms=(STOCK, FM), tasks=("niah_single",))
    done = {
        "stock": {8: rec(STOCK, 8, "niah_single", 1.0, [1, 2, 3]), 9: rec(STOCK, 9, "niah_single", 1.0, [1, 2, 3])},
        "FlashMemory@0.1": {
            8: rec(FM, 8, "niah_single", 1.0, [1, 2, 3], recall=3.0 * 1024),
            9: rec(FM, 9, "niah_single", 0.0, [1, 7, 7], recall=6.0 * 1024),
        },
    }
    replay = {"stock": {8: {"task_score": 1.0}, 9: {"task_score": 0.0}}, "FlashMemory@0.1": {8: {"task_score": 1.0}}}
    rtoks = {8: {"Full": [1, 2, 3], "FlashMemory@0.1": [1, 2, 3]}, 9: {"Full": [1, 2, 5], "FlashMemory@0.1": [1, 7, 7]}}
    res = aggregate(cfg, done, replay, rtoks)
    s, f = res["arms"]["stock"], res["arms"]["FlashMemory@0.1"]
    assert s["agree_with_replay"] == 1 and s["same_docs"] == 2 and s["tokens_equal_replay"] == 1
    assert s["replay_accuracy"]["mean"] == 0.5 and s["accuracy"]["mean"] == 1.0 and s["intervals_overlap"] is True
    (d,) = s["differences"]  # document 9: score 1 live, 0 in the replay; parts at token 2
    assert (d["index"], d["first_diff_vs_replay"], d["live_token"], d["replay_token"]) == (9, 2, 3, 5)
    assert f["tokens_equal_stock"] == 1 and f["docs_with_stock"] == 2 and f["tokens_equal_replay"] == 2
    assert f["same_docs"] == 1 and f["agree_with_replay"] == 1 and f["differences"] == []
    assert f["costs"]["recall_bytes"] == 4.5 * 1024 and f["costs"]["recall_bytes_per_token"] == 1.5 * 1024
    md = markdown(res, "flashmemory eval live ...", [], lambda ids: "w")
    assert "document 9 (niah_single): score live 1.000, replay 0.000; first differing token at 2" in md
    assert "| FlashMemory@0.1 | 2 | 0.500 [" in md and "1.50 KiB" in md


def test_intervals_that_do_not_overlap_are_marked(tmp_path, model_dir, retriever):
    cfg = small_config(tmp_path / "out", model_dir, retriever, arms=(STOCK,), tasks=("niah_single",), n_per_task=20)
    done = {"stock": {i: rec(STOCK, i, "niah_single", 1.0, [1]) for i in range(20)}}
    replay = {"stock": {i: {"task_score": 0.0} for i in range(20)}}
    res = aggregate(cfg, done, replay, {})
    assert res["arms"]["stock"]["intervals_overlap"] is False
    assert "| **no** |" in markdown(res, "c", [], lambda ids: "w")


def test_first_difference_and_setting_differences():
    assert first_difference([1, 2], [1, 2]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1 and first_difference([1], [1, 2]) == 1
    assert setting_differences({"tau": 16, "tasks": ("a",)}, {"tau": 64, "tasks": ["a"]}) == ["tau: live 16, replay 64"]


def test_write_report_drops_the_replay_column_for_other_documents(tmp_path, model_dir, retriever):
    """Document 8 of a 256-token run is not document 8 of the replay's 4,096-token run: no replay numbers."""
    from flashmemory.eval.live.report import write_report

    write_replay(tmp_path / "r", {8: (1.0, 0.5)})
    done = {"stock": {8: rec(STOCK, 8, "niah_single", 0.0, [1, 2]) | {"settings": {"kind": "stock", "top_k": 512}}}}
    for doc_len, has_replay in ((256, False), (4096, True)):
        cfg = small_config(tmp_path / "out", model_dir, retriever, arms=(STOCK,), doc_len=doc_len, gen_tokens=24)
        cfg = type(cfg)(**{**cfg.__dict__, "replay": str(tmp_path / "r"), "tasks": ("niah_single",)})
        (tmp_path / "out").mkdir(exist_ok=True)
        res = write_report(cfg, tmp_path / "out", done, log=lambda *a: None)
        md = (tmp_path / "out" / "live.md").read_text()
        assert (res["arms"]["stock"]["same_docs"] == 1) is has_replay
        assert ("no replay column" in md) is not has_replay
        if has_replay:  # replay tokens were not asked for: the difference says so, never "equal"
            assert "replay tokens not computed" in md and "tokens equal to the replay's" not in md
            assert "Index top-k: live 512 (the served model's), replay" not in md  # the stand-in replay has none


def test_replay_tokens_whose_scores_are_not_the_replay_runs_are_named(tmp_path):
    from flashmemory.eval.live.replay import ReplayTokens

    rt = ReplayTokens(tmp_path, "r", (0.1,), cfg=None)
    rt.scores = {8: {"Full": 1.0, "FlashMemory@0.1": 0.5}, 9: {"Full": 0.0, "FlashMemory@0.1": 0.0}}
    replay = {"stock": {8: {"task_score": 1.0}, 9: {"task_score": 1.0}}, "FlashMemory@0.1": {8: {"task_score": 0.5}}}
    (line,) = rt.check(replay)
    assert line.startswith("Replay tokens of document 9 score 0.000 as Full; the replay run's record 1.000 (stock)")


def test_iso_quality_picks_the_smallest_budget_reaching_the_ratio_live_and_replay(tmp_path, model_dir, retriever):
    fm2 = LiveArm("FlashMemory", 0.2)
    cfg = small_config(tmp_path / "out", model_dir, retriever, arms=(STOCK, FM, fm2), tasks=("niah_single",))
    # live: stock 1.0, FM@0.1 0.5, FM@0.2 1.0; replay: Full 0.5, FM 0.5 at both budgets
    live = {"stock": (1.0, 1.0), "FlashMemory@0.1": (1.0, 0.0), "FlashMemory@0.2": (1.0, 1.0)}
    arm = {"stock": STOCK, "FlashMemory@0.1": FM, "FlashMemory@0.2": fm2}
    done = {k: {i: rec(arm[k], i, "niah_single", s, [1]) for i, s in zip((8, 9), v)} for k, v in live.items()}
    replay = {k: {8: {"task_score": 1.0}, 9: {"task_score": 0.0}} for k in live}
    res = aggregate(cfg, done, replay, {})
    picks = res["iso"]["FlashMemory"]["niah_single"]
    assert picks["0.95"] == {"live": 0.2, "replay": 0.1} and picks["0.99"] == {"live": 0.2, "replay": 0.1}
    done["FlashMemory@0.2"][9]["task_score"] = 0.9  # 0.95 of stock's 1.0 reached at 20%, 0.99 at no budget run
    picks = aggregate(cfg, done, replay, {})["iso"]["FlashMemory"]["niah_single"]
    assert picks["0.95"]["live"] == 0.2 and picks["0.99"]["live"] is None
    md = markdown(aggregate(cfg, done, replay, {}), "cmd", [], lambda ids: "w")
    assert "| niah_single | 20% / 10% | - / 10% |" in md and "(up to 20%)" in md
