"""The cost model's pool sizing against the real decode server: launch_decode.sh on CPU with the tiny model
(DEVICE=cpu), stock and FlashMemory (CREDIT_C4=1), each at two --swa-full-tokens-ratio values (the ratio the script
picks for TGT_CONC x TGT_CTX, and sglang's DeepSeek-V4 default 0.1 with SWA_RATIO=sglang). Each server runs only
until its scheduler logs its pools, then is stopped. The model must give exactly what sglang logs: the bytes per
full token (ratio mode: c4/c128 + ratio x SWA slot), the SWA token pool and max_total_num_tokens."""

from __future__ import annotations

import dataclasses
import os
import re
import time
import uuid
from pathlib import Path

import pytest

from flashmemory.costmodel.flops import FlashShape
from flashmemory.costmodel.launch_settings import settings
from flashmemory.costmodel.pools import SGLANG_SWA_RATIO, Serving, bytes_per_full_token, capped_pools
from flashmemory.serve.procs import Servers, free_ports, loopback_env

pytestmark = [pytest.mark.live, pytest.mark.sglang, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[3]
# the tiny serving model (flashmemory/hf/serving_model.py): 6 layers, compress_ratios [0, 4, 128, 4, 128, 0]
TINY = FlashShape(hidden=256, n_layers=6, n_heads=8, o_groups=2, n_c4=2, n_c128=2, window=128)
MAX_TOTAL = 10000  # not a page multiple: the server floors it to 9,984
STARTUP_S = float(os.environ.get("FLASHMEMORY_LIVE_STARTUP_S", "600"))


def _pool_log(model: Path, logs: Path, flashmemory: bool, swa: str) -> str:
    """Start launch_decode.sh, wait for the scheduler's `max_total_num_tokens=` line, stop it; the log text."""
    port, boot = free_ports(2)
    env = loopback_env(
        {
            **os.environ,
            "DEVICE": "cpu",
            "MODEL": str(model),
            "CKPT": "",
            "PORT": str(port),
            "BOOTSTRAP_PORT": str(boot),
            "FLASHMEMORY": "1" if flashmemory else "0",
            "CREDIT_C4": "1",
            "SWA_RATIO": swa,
            "MAX_TOTAL_TOKENS": str(MAX_TOTAL),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
        },
        uuid.uuid4().hex,
    )
    with Servers(logs) as servers:
        p = servers.start(f"decode-fm{int(flashmemory)}-{swa}", ["bash", str(REPO / "launch_decode.sh")], env)
        deadline = time.monotonic() + STARTUP_S
        while "max_total_num_tokens=" not in p.log_text():
            assert p.popen.poll() is None, f"decode exited before sizing its pools:\n{p.log_tail()}"
            assert time.monotonic() < deadline, f"no pool sizes within {STARTUP_S:.0f} s:\n{p.log_tail()}"
            time.sleep(1.0)
        text = p.log_text()
    assert not servers.leftovers()
    return text


@pytest.mark.parametrize("flashmemory", [False, True], ids=["stock", "flashmemory"])
@pytest.mark.parametrize("swa", ["auto", "sglang"])
def test_model_gives_the_pools_the_server_logs(serving_model, tmp_path, flashmemory: bool, swa: str) -> None:
    text = _pool_log(Path(serving_model), tmp_path, flashmemory, swa)
    ratio = settings(4096, 4, 4, 1024, TINY.window).swa_ratio if swa == "auto" else SGLANG_SWA_RATIO
    sv = Serving(max_running=4, swa_ratio=ratio, credit_c4=flashmemory)
    sizing = re.findall(
        r"DSV4 SWA sizing: mode=(\w+) \((\w+)\), swa_tokens=\d+, swa_full_tokens_ratio=([\d.e-]+)", text
    )
    assert sizing and all(m == ("ratio", "explicit", repr(ratio)) for m in sizing), sizing
    bpt = re.findall(r"bytes_per_full_token=([\d.]+)", text)
    assert bpt and float(bpt[-1]) == round(bytes_per_full_token(sv, TINY), 2)
    full, swa_tokens = capped_pools(MAX_TOTAL, sv, TINY)
    assert re.findall(r"DSV4 pool sizes: full=(\d+), swa=(\d+)", text)[-1] == (str(full), str(swa_tokens))
    assert re.search(r"max_total_num_tokens=(\d+)", text).group(1) == str(full)
    if flashmemory:  # the credit reached sglang: a token costs no c4 KV bytes
        assert bytes_per_full_token(sv, TINY) < bytes_per_full_token(dataclasses.replace(sv, credit_c4=False), TINY)
