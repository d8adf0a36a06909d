"""`python -m flashmemory.env_check`: the plugin's own parser over the environment, one line per bad variable."""

import pytest

from flashmemory.env import EnvError, FlashMemoryEnv
from flashmemory.env_check import NAMES, check, listing, main, named_variable


def test_every_bad_variable_is_named_once():
    env = {
        "SGLANG_DECODE_SWAP_P": "1",
        "SGLANG_PATHP_PAGE_KMAX": "abc",
        "SGLANG_PATHP_DISK_GB": "-1",
        "SGLANG_PATHP_DISK_DIR": "/d",
        "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH_WIDTH": "0",
        "PATH": "/bin",
    }
    errors = check(env)
    assert sorted(e.split("=")[0] for e in errors) == [
        "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH_WIDTH",
        "SGLANG_PATHP_DISK_GB",
        "SGLANG_PATHP_PAGE_KMAX",
    ], errors
    assert check({"SGLANG_DECODE_SWAP_P": "true", "SGLANG_PATHP_DISK_DIR": "/d"}) == []


def test_a_cross_check_names_the_variable_it_is_about():
    errors = check({"SGLANG_FLASHMEMORY_DUMP": "1", "FLASHMEMORY_FAULT_INJECT": "x"})
    assert errors[0].startswith("SGLANG_FLASHMEMORY_DUMP=1 needs SGLANG_FLASHMEMORY_DUMP_ROOT")
    assert errors[1].startswith("FLASHMEMORY_FAULT_INJECT='x'") and len(errors) == 2
    assert named_variable("SGLANG_FLASHMEMORY_DUMP=1 needs X", {"SGLANG_FLASHMEMORY_DUMP_ROOT": "/r"}) is None


def test_prefetch_with_a_disk_directory_advises_what_the_next_check_accepts():
    """The disk tier without Path-P advised SGLANG_DECODE_SWAP_P=1, which the prefetch mode then refused."""
    env = {"SGLANG_FLASHMEMORY_HISPARSE_PREFETCH": "1", "SGLANG_PATHP_DISK_DIR": "/d"}
    with pytest.raises(EnvError, match=r"unset SGLANG_PATHP_DISK_DIR$") as e:
        FlashMemoryEnv.from_environ(env)
    assert "SGLANG_DECODE_SWAP_P=1" not in str(e.value)
    env.pop("SGLANG_PATHP_DISK_DIR")  # following the advice: accepted
    assert FlashMemoryEnv.from_environ(env).hisparse_prefetch


def test_listing_prints_the_set_variables_not_printed_already(capsys):
    env = {"SGLANG_PATHP_DISK_DIR": "/a b", "SGLANG_DECODE_SWAP_P": "0", "HOME": "/root"}
    assert listing(env, ["SGLANG_DECODE_SWAP_P"]) == ["ENV SGLANG_PATHP_DISK_DIR='/a b'"]
    assert main(["--print", "SGLANG_DECODE_SWAP_P"], env) == 2  # the disk tier without Path-P
    out, err = capsys.readouterr()
    assert out == "ENV SGLANG_PATHP_DISK_DIR='/a b'\n" and err.count("\n") == 1 and err.startswith("error: ")
    assert "SGLANG_PATHP_DISK_DIR" in NAMES and "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH" in NAMES
