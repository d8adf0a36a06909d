"""DiskTierConfig: the disk tier's three variables, parsed and validated with one-line errors."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from flashmemory.env import DiskTierConfig, EnvError, FlashMemoryEnv
from flashmemory.env_doc import ENV_DOC


def test_defaults_off_and_documented() -> None:
    d = DiskTierConfig.from_environ({})
    assert d == DiskTierConfig() and not d.enabled
    assert FlashMemoryEnv.from_environ({}).disk == d
    assert ENV_DOC["SGLANG_PATHP_DISK_GB"][0] == f"{d.disk_gb:g}"
    assert ENV_DOC["SGLANG_PATHP_HOST_CACHE_GB"][0] == f"{d.host_cache_gb:g}"
    assert ENV_DOC["SGLANG_PATHP_DISK_DIR"][0] == d.dir
    assert ENV_DOC["SGLANG_PATHP_HOST_MIRROR_GB"][0] == "" and d.host_mirror_bytes is None  # unset: full size
    read = set(re.findall(r'"(SGLANG_[A-Z0-9_]+)"', inspect.getsource(DiskTierConfig.from_environ)))
    assert (
        read
        == {
            "SGLANG_PATHP_DISK_DIR",
            "SGLANG_PATHP_DISK_GB",
            "SGLANG_PATHP_HOST_CACHE_GB",
            "SGLANG_PATHP_HOST_MIRROR_GB",
        }
        <= set(ENV_DOC)
    )


def test_parsing() -> None:
    d = FlashMemoryEnv.from_environ(
        {
            "SGLANG_DECODE_SWAP_P": "1",
            "SGLANG_PATHP_DISK_DIR": " /nvme/fm ",
            "SGLANG_PATHP_DISK_GB": "0.5",
            "SGLANG_PATHP_HOST_CACHE_GB": "2",
            "SGLANG_PATHP_HOST_MIRROR_GB": "1.5",
        }
    ).disk
    assert d.enabled and d.dir == "/nvme/fm" and d.disk_bytes == 500_000_000 and d.host_cache_bytes == 2 * 10**9
    assert d.host_mirror_bytes == 1_500_000_000
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.dir = "/x"  # type: ignore[misc]  # frozen


@pytest.mark.parametrize(
    "env,why",
    [
        ({"SGLANG_PATHP_DISK_DIR": "rel/dir"}, "SGLANG_PATHP_DISK_DIR='rel/dir': must be an absolute directory"),
        ({"SGLANG_PATHP_DISK_DIR": "/d", "SGLANG_PATHP_DISK_GB": "0"}, "SGLANG_PATHP_DISK_GB=0.0: must be > 0"),
        ({"SGLANG_PATHP_DISK_DIR": "/d", "SGLANG_PATHP_DISK_GB": "-1"}, "SGLANG_PATHP_DISK_GB=-1.0: must lie in"),
        (
            {"SGLANG_PATHP_DISK_DIR": "/d", "SGLANG_PATHP_DISK_GB": "lots"},
            "SGLANG_PATHP_DISK_GB='lots': expected a number",
        ),
        ({"SGLANG_PATHP_DISK_DIR": "/d", "SGLANG_PATHP_DISK_GB": "nan"}, "SGLANG_PATHP_DISK_GB=nan"),
        ({"SGLANG_PATHP_DISK_DIR": "/d", "SGLANG_PATHP_DISK_GB": "inf"}, "SGLANG_PATHP_DISK_GB=inf"),
        (
            {"SGLANG_PATHP_DISK_DIR": "/d", "SGLANG_PATHP_DISK_GB": "1e12"},
            "SGLANG_PATHP_DISK_GB=1000000000000.0: must lie in",
        ),
        (
            {"SGLANG_PATHP_DISK_DIR": "/d", "SGLANG_PATHP_HOST_CACHE_GB": "0"},
            "SGLANG_PATHP_HOST_CACHE_GB=0.0: must be > 0",
        ),
        ({"SGLANG_PATHP_DISK_GB": "10"}, "SGLANG_PATHP_DISK_GB is set but SGLANG_PATHP_DISK_DIR is not"),
        ({"SGLANG_PATHP_HOST_CACHE_GB": "1"}, "SGLANG_PATHP_HOST_CACHE_GB is set but SGLANG_PATHP_DISK_DIR is not"),
        (
            {"SGLANG_PATHP_DISK_DIR": "/d", "SGLANG_PATHP_HOST_MIRROR_GB": "0"},
            "SGLANG_PATHP_HOST_MIRROR_GB=0.0: must be > 0",
        ),
        (
            {"SGLANG_PATHP_DISK_DIR": "/d", "SGLANG_PATHP_HOST_MIRROR_GB": "-2"},
            "SGLANG_PATHP_HOST_MIRROR_GB=-2.0: must lie in",
        ),
        (
            {"SGLANG_PATHP_DISK_DIR": "/d", "SGLANG_PATHP_HOST_MIRROR_GB": "small"},
            "SGLANG_PATHP_HOST_MIRROR_GB='small': expected a number",
        ),
        ({"SGLANG_PATHP_HOST_MIRROR_GB": "4"}, "SGLANG_PATHP_HOST_MIRROR_GB is set but SGLANG_PATHP_DISK_DIR is not"),
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], why: str) -> None:
    with pytest.raises(EnvError, match=why) as e:
        FlashMemoryEnv.from_environ(env)
    assert "\n" not in str(e.value)
