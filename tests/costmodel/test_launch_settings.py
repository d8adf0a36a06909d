"""The pool settings launch_decode.sh passes (`flashmemory.costmodel.launch_settings`): the smallest SWA ratio for
TGT_CONC x TGT_CTX, and with CREDIT_C4=1 the memory fraction lowered by the reserve the plugin sizes, or one line
naming the variable when they cannot be derived."""

from __future__ import annotations

import json

import pytest

from flashmemory.costmodel.admission import fm_reserve_bytes
from flashmemory.costmodel.launch_settings import main, settings, window_of
from flashmemory.costmodel.pools import Serving, smallest_swa_ratio


def test_ratio_is_the_smallest_for_the_target() -> None:
    s = settings(524288, 60, 128, 1024)
    assert s.swa_ratio == smallest_swa_ratio(60, 524288, Serving(max_running=128)) == 0.00159
    assert s.mem_fraction is None and s.reserve_bytes == 0.0  # stock, or FlashMemory without the credit
    # 59 live windows of 768 + the newcomer's 256-slot tail + 4,096 + a page, over 60 x (512K + 1,024)
    assert s.swa_ratio == pytest.approx((59 * 768 + 256 + 4096 + 256) / (60 * (524288 + 1024)), abs=1e-5)
    assert settings(4096, 4, 4, 1024).swa_ratio == 0.3375  # the CPU launch of the tiny model


def test_credit_lowers_the_fraction_by_the_reserve() -> None:
    s = settings(524288, 60, 128, 1024, credit_c4=True, kmax=96, gpu_mib=97871, tp=8)
    assert s.reserve_bytes == fm_reserve_bytes(60, 96, 128) == 5_381_812_800
    assert s.mem_fraction == round(0.895 - 5_381_812_800 / (97871 * 2**20), 3) == 0.843
    assert settings(524288, 60, 128, 1024, credit_c4=True, gpu_mib=97871, mem_fraction=0.8).mem_fraction == 0.748
    with pytest.raises(ValueError, match="set GPU_MIB"):
        settings(524288, 60, 128, 1024, credit_c4=True)
    with pytest.raises(ValueError, match="lower TGT_CONC or KMAX"):
        settings(524288, 600, 512, 1024, credit_c4=True, gpu_mib=40000)


def test_window_from_the_checkpoint(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"window_size": 256}))
    assert window_of(str(tmp_path)) == 256 and window_of(None) == 128 and window_of(str(tmp_path / "x")) == 128


def test_cli_prints_one_line_or_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--context", "524288", "--concurrency", "60", "--max-running", "128"]) == 0
    assert capsys.readouterr().out == "0.00159 - 0.00\n"
    argv = ["--context", "524288", "--concurrency", "60", "--max-running", "128", "--credit-c4", "1"]
    assert main([*argv, "--gpu-mib", "97871"]) == 0
    assert capsys.readouterr().out == "0.00159 0.843 5.01\n"
    for bad, word in ((["--gpu-mib", "-5"], "GPU_MIB"), (["--mem-fraction", "2"], "MEM_FRAC"), ([], "GPU_MIB")):
        assert main([*argv, *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and word in err and "\n" not in err
