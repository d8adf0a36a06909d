"""`flashmemory bench tier` runs on a tiny geometry, prints its ratio and window columns and writes JSON (no
timing is asserted); bad flags are one line and exit 2; the temp store directory is removed after."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from flashmemory.cli import main


def test_bench_tier_tiny(tmp_path, capsys) -> None:
    out = tmp_path / "tier.json"
    before = set(os.listdir(tempfile.gettempdir()))
    assert (
        main(
            [
                "bench",
                "tier",
                "--pages",
                "3",
                "--conc",
                "1",
                "2",
                "--layers",
                "4",
                "--reps",
                "1",
                "--readers",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "disk/host" in text and "stops fitting" in text and "window: disk" in text
    r = json.loads(out.read_text())
    assert r["page_bytes"] == 4 * 37440 + 1 * 8448 and [x["conc"] for x in r["rows"]] == [1, 2]
    for x in r["rows"]:
        assert x["bytes"] == x["conc"] * 3 * r["page_bytes"] and x["disk_s"] > 0 and x["host_s"] > 0
        assert x["ratio"] == x["disk_s"] / x["host_s"]
    assert r["counters"]["disk_bytes_read"] >= 9 * r["page_bytes"] and r["fit_conc_disk"] >= 0
    # Host mirror DRAM at the default 1,048,576 tokens: 262,144 c4 chunks = 4,096 pages of 64 per request; the
    # window's floor is 3 page slots per request (its tail page plus the two one step's appends may open).
    assert r["context"] == 1048576 and "landing window" in text
    for m in r["mirror_dram"]:
        assert m["pages"] == m["conc"] * 4096 and m["full_bytes"] == m["pages"] * r["page_bytes"]
        assert m["window_slots"] == 3 * m["conc"] and m["window_bytes"] == 3 * m["conc"] * r["page_bytes"]
    leftover = {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("fm-bench-tier-")}
    assert not leftover


def test_bench_tier_store_in_a_given_dir_is_removed(tmp_path, capsys) -> None:
    assert main(["bench", "tier", "--pages", "2", "--conc", "1", "--layers", "4", "--dir", str(tmp_path)]) == 0
    assert os.listdir(tmp_path) == []  # the store file was ours and is gone; the directory stays


def test_bench_tier_bad_flags(tmp_path, capsys) -> None:
    assert main(["bench", "tier", "--dir", str(tmp_path / "nope")]) == 2
    assert "--dir" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse's own one line: not a finite number
        main(["bench", "tier", "--step-ms", "nan"])
    assert e.value.code == 2 and "--step-ms" in capsys.readouterr().err
    assert main(["bench", "tier", "--context", "2"]) == 2
    assert "--context" in capsys.readouterr().err
