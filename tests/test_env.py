"""FlashMemoryEnv: defaults, parsing, and errors that name the variable."""

from __future__ import annotations

import inspect
import math
import re

import pytest

from flashmemory.env import EnvError, FlashMemoryEnv, parse_layers
from flashmemory.env_doc import ENV_DOC


def test_defaults_match_the_documented_ones() -> None:
    env = FlashMemoryEnv.from_environ({})
    assert env == FlashMemoryEnv()
    assert not env.any_gate and not env.level1_enabled and env.active_features() == []
    assert (
        env.retriever_layers,
        env.interval,
        env.threshold,
        env.last_keep,
        env.first_keep,
        env.ensemble_mode,
        env.page_kmax,
        env.max_position,
    ) == ((10, 12, 20), 64, 0.5, 2048, 0, "or", 96, 1048576)
    # ENV_DOC's defaults are the dataclass's (the README table prints ENV_DOC).
    assert ENV_DOC["SGLANG_PATHP_PAGE_KMAX"][0] == str(env.page_kmax)
    assert ENV_DOC["SGLANG_RETRIEVER_LAST_KEEP"][0] == str(env.last_keep)
    assert ENV_DOC["SGLANG_RETRIEVER_INLINE_LAYERS"][0] == ",".join(map(str, env.retriever_layers))
    # Every variable from_environ reads is documented.
    src = inspect.getsource(FlashMemoryEnv.from_environ)
    read = set(re.findall(r'"((?:SGLANG|FLASHMEMORY)_[A-Z0-9_]+)"', src))
    assert read and read <= set(ENV_DOC), read - set(ENV_DOC)


def test_parsing() -> None:
    env = FlashMemoryEnv.from_environ(
        {
            "SGLANG_DECODE_SWAP_P": "1",
            "SGLANG_PATHP_SCORE_RESIDENT": "true",
            "SGLANG_PATHP_ASYNC_RECALL": "off",
            "SGLANG_RETRIEVER_INLINE_CKPT": " ckpt.safetensors ",
            "SGLANG_RETRIEVER_INLINE_LAYERS": "20, 10,10",
            "SGLANG_RETRIEVER_INTERVAL": "32",
            "SGLANG_RETRIEVER_SIGMOID_THRESH": "0.25",
            "SGLANG_RETRIEVER_ENSEMBLE_MODE": "MEAN",
            "SGLANG_RETRIEVER_PAGE_POLICY": " Threshold ",
            "SGLANG_RETRIEVER_LOGIT_OFFSET": "-5.5",
            "SGLANG_PATHP_PAGE_KMAX": "",
            "SGLANG_DSV4_TARGET_CONCURRENCY": "8",
        }
    )
    assert env.decode_swap_p and env.score_resident and not env.async_recall
    assert env.retriever_ckpt == "ckpt.safetensors" and env.level1_enabled
    assert env.retriever_layers == (10, 20) and env.interval == 32 and env.threshold == 0.25
    assert env.ensemble_mode == "mean" and env.logit_offset == -5.5 and env.page_policy == "threshold"
    assert FlashMemoryEnv.from_environ({}).page_policy == "fill"  # Level 1 spends KMAX unless told otherwise
    assert env.page_kmax == 96  # empty string = default
    assert env.auto_reserve_pages() == 8 * 97
    assert "level1(layers=10,20,tau=32)" in env.active_features() and "path-p" in env.active_features()
    assert FlashMemoryEnv.from_environ({"SGLANG_RETRIEVER_ENSEMBLE_MODE": "max"}).ensemble_mode == "or"
    assert FlashMemoryEnv.from_environ({"SGLANG_PATHP_RESERVE_PAGES": "77"}).auto_reserve_pages() == 77


def test_kmax_ratio() -> None:
    env = FlashMemoryEnv.from_environ({"SGLANG_PATHP_PAGE_KMAX_RATIO": "0.1", "SGLANG_DSV4_TARGET_CONTEXT": "262144"})
    # 262144 tokens = 65536 c4 chunks = 1024 pages; 10% of them, rounded up.
    assert env.kmax() == math.ceil(0.1 * 1024) == 103
    assert FlashMemoryEnv.from_environ({"SGLANG_PATHP_PAGE_KMAX": "5"}).kmax() == 5


@pytest.mark.parametrize(
    "name,value,why",
    [
        ("SGLANG_PATHP_PAGE_KMAX", "abc", "integer"),
        ("SGLANG_PATHP_PAGE_KMAX", "0", ">= 1"),
        ("SGLANG_PATHP_PAGE_KMAX", "9.5", "integer"),
        ("SGLANG_RETRIEVER_INLINE_LAYERS", "10,21", "21"),
        ("SGLANG_RETRIEVER_INLINE_LAYERS", "10,x", "comma-separated"),
        ("SGLANG_RETRIEVER_INLINE_LAYERS", ",", "no layer"),
        ("SGLANG_RETRIEVER_INLINE_LAYERS", "-1", "-1"),
        ("SGLANG_RETRIEVER_ENSEMBLE_MODE", "xor", "xor"),
        ("SGLANG_RETRIEVER_PAGE_POLICY", "mass", "'fill' or 'threshold'"),
        ("SGLANG_RETRIEVER_SIGMOID_THRESH", "1.5", r"\[0.0, 1.0\]"),
        ("SGLANG_RETRIEVER_SIGMOID_THRESH", "nan", "0.0"),
        ("SGLANG_RETRIEVER_SIGMOID_THRESH", "half", "number"),
        ("SGLANG_RETRIEVER_INTERVAL", "-3", ">= 1"),
        ("SGLANG_DECODE_SWAP_P", "maybe", "0/1"),
        ("SGLANG_RETRIEVER_LOGIT_OFFSET", "inf", "must lie"),
        # Sizes a typo makes absurd are named here, not met later as an overflow or a failed allocation.
        ("SGLANG_PATHP_PAGE_KMAX", "1e20", "integer"),
        ("SGLANG_PATHP_PAGE_KMAX", str(10**20), "<= "),
        ("SGLANG_PATHP_PAGE_KMAX", "5000", "SGLANG_RETRIEVER_MAX_POSITION=1048576 tokens has \\(4096 pages"),
        ("SGLANG_PATHP_RESERVE_PAGES", str(10**12), "<= 16777216"),
        ("SGLANG_PATHP_DECODE_MAX_CONC", str(10**9), "<= 65536"),
        ("SGLANG_DSV4_TARGET_CONCURRENCY", str(10**9), "<= 65536"),
        ("SGLANG_RETRIEVER_MAX_POSITION", str(10**15), "<= "),
    ],
)
def test_bad_values_name_the_variable(name: str, value: str, why: str) -> None:
    with pytest.raises(EnvError, match=name) as e:
        FlashMemoryEnv.from_environ({name: value})
    assert re.search(why, str(e.value)), str(e.value)


def test_parse_layers() -> None:
    assert parse_layers("20,12, 10") == (10, 12, 20)
    assert parse_layers("3", n_c4_layers=4) == (3,)
    with pytest.raises(EnvError, match="MY_VAR"):
        parse_layers("4", name="MY_VAR", n_c4_layers=4)
    assert issubclass(EnvError, ValueError)


def test_from_environ_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_RETRIEVER_INTERVAL", "16")
    assert FlashMemoryEnv.from_environ().interval == 16
    monkeypatch.setenv("SGLANG_RETRIEVER_INTERVAL", "sixteen")
    with pytest.raises(EnvError, match="SGLANG_RETRIEVER_INTERVAL"):
        FlashMemoryEnv.from_environ()


def test_dump_mode_needs_an_absolute_root() -> None:
    """The dump server writes only under a root its operator sets; without one it does not start."""
    with pytest.raises(EnvError, match="SGLANG_FLASHMEMORY_DUMP=1 needs SGLANG_FLASHMEMORY_DUMP_ROOT"):
        FlashMemoryEnv.from_environ({"SGLANG_FLASHMEMORY_DUMP": "1"})
    with pytest.raises(EnvError, match="SGLANG_FLASHMEMORY_DUMP_ROOT='dumps': must be an absolute directory"):
        FlashMemoryEnv.from_environ({"SGLANG_FLASHMEMORY_DUMP": "1", "SGLANG_FLASHMEMORY_DUMP_ROOT": "dumps"})
    e = FlashMemoryEnv.from_environ({"SGLANG_FLASHMEMORY_DUMP": "1", "SGLANG_FLASHMEMORY_DUMP_ROOT": "/data/d"})
    assert e.dump_mode and e.dump_root == "/data/d"
    assert FlashMemoryEnv.from_environ({}).dump_root == ""  # gates off: nothing required


def test_miss_low_above_miss_threshold_is_refused() -> None:
    """README "Errors and data safety": every numeric input is range-checked where it is read, the
    `SGLANG_*` variables included. A shrink-back level above the escalation level would make the monitor
    escalate and shrink on the same cycle; it was accepted without a word. The error names both variables."""
    with pytest.raises(EnvError, match="SGLANG_RETRIEVER_MISS_LOW=0.3 is above SGLANG_RETRIEVER_MISS_THRESHOLD=0.2"):
        FlashMemoryEnv.from_environ({"SGLANG_RETRIEVER_MISS_LOW": "0.3"})
    with pytest.raises(EnvError, match="SGLANG_RETRIEVER_MISS_THRESHOLD=0.01"):
        FlashMemoryEnv.from_environ({"SGLANG_RETRIEVER_MISS_THRESHOLD": "0.01"})
    e = FlashMemoryEnv.from_environ({"SGLANG_RETRIEVER_MISS_LOW": "0.2", "SGLANG_RETRIEVER_MISS_THRESHOLD": "0.2"})
    assert e.miss_low == e.miss_threshold == 0.2  # equal levels are allowed
