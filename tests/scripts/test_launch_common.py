"""scripts/launch_common.sh: the launch scripts read FlashMemory's variables as the plugin does, and DRY_RUN=1 prints
and checks every one of them (the plugin's own parser, `python -m flashmemory.env_check`)."""

import os
import shlex
import subprocess

import pytest

from flashmemory.env import EnvError, read_bool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPELLINGS = ["1", "true", "TRUE", " yes ", "on", "On", "0", "false", "no", "off", "", "maybe", "2"]


def _dry(script: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "FLASHMEMORY_"))}
    e.update({"DRY_RUN": "1", "MODEL": ROOT, **env})
    return subprocess.run(["bash", os.path.join(ROOT, script)], env=e, capture_output=True, text=True, timeout=60)


def _envs(out: str) -> dict[str, str]:
    pairs = (ln[4:].split("=", 1) for ln in out.splitlines() if ln.startswith("ENV "))
    return {k: (shlex.split(v) or [""])[0] for k, v in pairs}


def _plugin_on(v: str) -> bool | None:
    try:
        return read_bool({"X": v}, "X", False)
    except EnvError:
        return None


@pytest.mark.parametrize("v", SPELLINGS)
def test_fm_on_reads_a_boolean_as_the_plugin_does(v):
    p = subprocess.run(
        ["bash", "-c", f'source {ROOT}/scripts/launch_common.sh; fm_on "$1"', "_", v], capture_output=True
    )
    assert (p.returncode == 0) == bool(_plugin_on(v)), v


@pytest.mark.parametrize("v", ["1", "true", "yes", "On"])
def test_the_prefetch_mode_keeps_its_hint_checkpoint_for_every_on_spelling(v):
    """With FLASHMEMORY=0 the decode script clears CKPT unless the prefetch mode is on; it kept it only for exactly
    `1`, while the plugin reads `true` as on too: prefetch then ran with no hint."""
    p = _dry("launch_decode.sh", FLASHMEMORY="0", CKPT="/ckpt.pt", SGLANG_FLASHMEMORY_HISPARSE_PREFETCH=v)
    assert p.returncode == 0, p.stderr
    assert _envs(p.stdout)["SGLANG_RETRIEVER_INLINE_CKPT"] == "/ckpt.pt"
    off = _dry("launch_decode.sh", FLASHMEMORY="0", CKPT="/ckpt.pt", SGLANG_FLASHMEMORY_HISPARSE_PREFETCH="false")
    assert _envs(off.stdout)["SGLANG_RETRIEVER_INLINE_CKPT"] == ""


@pytest.mark.parametrize("script", ["launch_decode.sh", "launch_prefill.sh"])
def test_dry_run_prints_the_disk_tier_and_prefetch_variables(script):
    env = {
        "SGLANG_PATHP_DISK_DIR": "/data/pages",
        "SGLANG_PATHP_DISK_GB": "32",
        "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH_WIDTH": "32",
    }
    if script == "launch_prefill.sh":  # P runs without Path-P: the disk tier is refused there, so leave it out
        env = {"SGLANG_FLASHMEMORY_HISPARSE_PREFETCH_WIDTH": "32"}
    p = _dry(script, **env)
    assert p.returncode == 0, p.stderr
    got = _envs(p.stdout)
    assert all(got[k] == v for k, v in env.items()), p.stdout
    assert p.stdout.rstrip().splitlines()[-1].startswith("CMD ")


@pytest.mark.parametrize(
    "env,msg",
    [
        ({"SGLANG_PATHP_DISK_GB": "lots", "SGLANG_PATHP_DISK_DIR": "/d"}, "SGLANG_PATHP_DISK_GB='lots'"),
        ({"SGLANG_PATHP_DISK_DIR": "rel/dir"}, "SGLANG_PATHP_DISK_DIR='rel/dir': must be an absolute directory"),
        ({"SGLANG_FLASHMEMORY_HISPARSE_PREFETCH": "maybe"}, "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH='maybe'"),
        ({"SGLANG_FLASHMEMORY_HISPARSE_PREFETCH": "true"}, "with SGLANG_DECODE_SWAP_P=1"),
    ],
)
def test_dry_run_checks_every_flashmemory_variable(env, msg):
    """DRY_RUN=1 used to print and check none of the disk-tier and prefetch variables: each bad one passed."""
    p = _dry("launch_decode.sh", **env)
    assert p.returncode == 2 and "CMD" not in p.stdout, (p.stdout, p.stderr)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and msg in errors[0], p.stderr


def test_two_bad_variables_are_two_lines():
    p = _dry("launch_decode.sh", SGLANG_PATHP_DISK_DIR="rel", SGLANG_FLASHMEMORY_HISPARSE_PREFETCH_WIDTH="0")
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert p.returncode == 2 and len(errors) == 2, p.stderr


def test_prefetch_with_a_disk_directory_advice_is_accepted_when_followed():
    """FLASHMEMORY=0 with the prefetch mode and a disk directory: the advice (unset the directory) is a setting the
    next run accepts; it used to advise SGLANG_DECODE_SWAP_P=1, which the prefetch check then refused."""
    base = {"FLASHMEMORY": "0", "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH": "1"}
    p = _dry("launch_decode.sh", SGLANG_PATHP_DISK_DIR="/d", **base)
    assert p.returncode == 2 and "unset SGLANG_PATHP_DISK_DIR" in p.stderr, p.stderr
    assert _dry("launch_decode.sh", **base).returncode == 0


@pytest.mark.parametrize("v", SPELLINGS)
def test_fm_flag_reads_a_knob_as_the_plugin_reads_a_boolean(v):
    """The scripts' own boolean knobs (C4_SHRINK, FLASHMEMORY, MINI_LB, ...) took only 0 and 1 while the variables
    they set take true/yes/on too; now each is read as the plugin reads a boolean, and a bad one is refused."""
    p = subprocess.run(
        ["bash", "-c", f'source {ROOT}/scripts/launch_common.sh; K="$1"; fm_flag K; echo "$K"', "_", v],
        capture_output=True,
        text=True,
    )
    want = _plugin_on(v)
    if want is None or v == "":  # the plugin's empty means "default"; a knob the script reads has its default set
        assert p.returncode == 2 and f"K={v}: expected 0/1" in p.stderr, p.stderr
    else:
        assert p.returncode == 0 and p.stdout.strip() == str(int(want)), (p.stdout, p.stderr)


def test_knobs_spelled_true_and_false_reach_the_plugin_as_one_and_zero():
    got = _envs(_dry("launch_decode.sh", DEVICE="cpu", C4_SHRINK="false", CREDIT_C4="yes", SCORE_RESIDENT="off").stdout)
    assert (got["SGLANG_PD_B_C4_SHRINK"], got["SGLANG_PD_CREDIT_OFFLOADED_C4"]) == ("0", "1")
    assert got["SGLANG_PATHP_SCORE_RESIDENT"] == "0"
    stock = _envs(_dry("launch_decode.sh", FLASHMEMORY="False").stdout)
    assert stock["SGLANG_DECODE_SWAP_P"] == "0" and stock["SGLANG_RETRIEVER_INLINE_CKPT"] == ""
    router = _dry("launch_router.sh", MINI_LB="true")
    assert router.returncode == 0 and " --mini-lb " in router.stdout, router.stderr
