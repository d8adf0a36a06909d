"""`flashmemory bench monitor` runs and prints its ratio column (no timing is asserted)."""

from flashmemory.cli import main


def test_bench_monitor_prints_the_ratio(capsys):
    assert main(["bench", "monitor", "--sizes", "256,1024", "--repeats", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "(monitor/64) / (native x21)" in out and "1,024" in out


def test_bench_monitor_bad_sizes(capsys):
    assert main(["bench", "monitor", "--sizes", "a,b"]) == 2
    assert capsys.readouterr().err.startswith("flashmemory bench monitor: error: --sizes 'a,b'")
