"""DRY_RUN commands of the launch scripts parse with sglang's / sglang_router's own parsers; bad knobs fail."""

import argparse
import os
import shlex
import subprocess

import pytest

pytestmark = pytest.mark.sglang
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVERS = ["launch_decode.sh", "launch_prefill.sh", "data_generation/start_dump_server.sh"]


def dry(script, **env):
    root = {"DUMP_ROOT": "/tmp"} if "dump" in script else {}  # the dump server needs its write root
    e = {**os.environ, "DRY_RUN": "1", **root, **env}
    return subprocess.run(["bash", os.path.join(ROOT, script)], env=e, capture_output=True, text=True, timeout=60)


def command(script, **env):
    p = dry(script, **env)
    assert p.returncode == 0, p.stderr
    cmd = [ln for ln in p.stdout.splitlines() if ln.startswith("CMD ")]
    envs = {
        k: (shlex.split(v) or [""])[0]
        for k, v in (ln[4:].split("=", 1) for ln in p.stdout.splitlines() if ln.startswith("ENV "))
    }  # values are %q-quoted
    return shlex.split(cmd[0][4:]), envs


@pytest.mark.parametrize("script", SERVERS)
def test_server_commands_parse(sg, script):
    argv, envs = command(script)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    p = argparse.ArgumentParser()
    sg["server_args"].ServerArgs.add_cli_args(p)
    ns = p.parse_args(argv[3:])
    assert ns.trust_remote_code and ns.tp_size == 8
    if script == "launch_decode.sh":
        assert ns.disaggregation_mode == "decode" and ns.disaggregation_transfer_backend == "nixl"
        assert envs["SGLANG_DECODE_SWAP_P"] == "1" and envs["SGLANG_PATHP_PAGE_KMAX"] == "96"
    else:
        assert ns.cuda_graph_backend_decode == "disabled"
    if "dump" in script:
        assert envs["SGLANG_FLASHMEMORY_DUMP"] == "1" and envs["SGLANG_DECODE_SWAP_P"] == "0"


def test_decode_knobs(sg):
    argv, envs = command("launch_decode.sh", TRANSFER_BACKEND="mooncake", KMAX="192", CUDA_GRAPH="0")
    p = argparse.ArgumentParser()
    sg["server_args"].ServerArgs.add_cli_args(p)
    ns = p.parse_args(argv[3:])
    assert ns.disaggregation_transfer_backend == "mooncake" and ns.cuda_graph_backend_decode == "disabled"
    assert envs["SGLANG_PATHP_PAGE_KMAX"] == "192"
    from flashmemory.env import FlashMemoryEnv
    from flashmemory.sglang.decode.shrink_adapter import shrink_blockers

    assert any("nixl" in b for b in shrink_blockers(ns))  # mooncake: Path-P falls back to copy mode
    argv, envs = command("launch_decode.sh", CREDIT_C4="1", GPU_MIB="97871")
    e = FlashMemoryEnv.from_environ(envs)
    assert e.decode_swap_p and e.pd_c4_shrink and e.pd_credit_c4
    ns = p.parse_args(argv[3:])
    assert shrink_blockers(ns) == []  # the default D command runs the shrink
    # the pools: the smallest SWA ratio for TGT_CONC 60 x TGT_CTX 512K, and sglang's 0.895 on an H20 lowered by the
    # reserve (60 x 97 + 128 x 8 + 1 blocks of 21 x 37,440 B = 5.38 GB)
    assert ns.swa_full_tokens_ratio == 0.00159
    assert ns.mem_fraction_static == round(0.895 - 6845 * 21 * 37440 / (97871 * 2**20), 3) == 0.843
    stock, _ = command("launch_decode.sh", FLASHMEMORY="0", CREDIT_C4="1", GPU_MIB="97871")
    ns0 = p.parse_args(stock[3:])
    assert ns0.swa_full_tokens_ratio == 0.00159 and ns0.mem_fraction_static is None  # same SWA pool, no reserve
    assert p.parse_args(command("launch_decode.sh", SWA_RATIO="sglang")[0][3:]).swa_full_tokens_ratio is None


@pytest.mark.parametrize("mini", ["0", "1"])
def test_router_command_parses(mini):
    from sglang_router.launch_router import parse_router_args

    argv, _ = command("launch_router.sh", MINI_LB=mini, PREFILL_IP="10.0.0.1", DECODE_IP="10.0.0.2")
    assert argv[1:3] == ["-m", "sglang_router.launch_router"]
    ra = parse_router_args(argv[3:])
    assert ra.pd_disaggregation and ra.port == 31503 and ra.mini_lb == (mini == "1")
    assert ra.prefill_urls == [("http://10.0.0.1:31100", 8998)] and ra.decode_urls == ["http://10.0.0.2:31200"]


@pytest.mark.parametrize(
    "script,env,msg",
    [
        ("launch_decode.sh", {"KMAX": "abc"}, "KMAX=abc"),
        ("launch_decode.sh", {"LAYERS": "10,25"}, "layer 25"),
        ("launch_decode.sh", {"TRANSFER_BACKEND": "rdma"}, "TRANSFER_BACKEND"),
        ("launch_decode.sh", {"C4_SHRINK": "maybe"}, "C4_SHRINK=maybe: expected 0/1"),
        ("launch_decode.sh", {"DEVICE": "gpu"}, "DEVICE=gpu"),
        ("launch_prefill.sh", {"SWA_RATIO": "2"}, "SWA_RATIO"),
        ("launch_router.sh", {"MINI_LB": "2"}, "MINI_LB=2: expected 0/1"),
        # bash arithmetic wraps 2^64 + 1 to 1, so it passed the >= 1 check; now the string is checked first
        (
            "launch_decode.sh",
            {"KMAX": "18446744073709551617"},
            "KMAX=18446744073709551617 is too large (at most 9 digits",
        ),
        ("launch_prefill.sh", {"PORT": "99999999999999999999"}, "PORT=99999999999999999999 is too large"),
        ("launch_router.sh", {"PROMETHEUS_PORT": "1000000000"}, "PROMETHEUS_PORT=1000000000 is too large"),
    ],
)
def test_bad_knobs(script, env, msg):
    """README "Errors and data safety": every numeric input is range-checked where it is read, with one clear
    line naming the variable and a non-zero exit."""
    p = dry(script, **env)
    assert p.returncode != 0 and msg in p.stderr and "CMD" not in p.stdout
    assert len([ln for ln in p.stderr.splitlines() if not ln.startswith("warning:")]) == 1, p.stderr


def test_a_leading_zero_is_decimal_not_a_bash_error():
    """KMAX=08 printed bash's "value too great for base" beside the project's own check (bash reads a
    leading 0 as octal). README "Errors and data safety": one line, never a shell error; 08 is read as 8."""
    p = dry("launch_decode.sh", KMAX="08")
    assert p.returncode == 0 and "base" not in p.stderr and "line" not in p.stderr, p.stderr
    assert "ENV SGLANG_PATHP_PAGE_KMAX=08" in p.stdout
    from flashmemory.env import FlashMemoryEnv

    assert FlashMemoryEnv.from_environ({"SGLANG_PATHP_PAGE_KMAX": "08"}).page_kmax == 8
    p = dry("launch_decode.sh", KMAX="00")
    assert p.returncode != 0 and p.stderr.strip() == "error: KMAX=00 must be >= 1", p.stderr


@pytest.mark.parametrize("script", SERVERS)
def test_cpu_commands_parse(sg, script):
    """DEVICE=cpu: sglang's CPU flags, no GPU-only flag, the CPU layer's switch and sglang's own CPU switches."""
    argv, envs = command(script, DEVICE="cpu")
    p = argparse.ArgumentParser()
    sg["server_args"].ServerArgs.add_cli_args(p)
    ns = p.parse_args(argv[3:])
    assert ns.device == "cpu" and ns.tp_size == 1 and ns.context_length == 4096 and ns.dsa_topk_backend == "torch"
    assert ns.max_total_tokens == 16384 and ns.cuda_graph_backend_decode == "disabled"
    assert "--moe-runner-backend" not in argv and "--base-gpu-id" not in argv
    assert envs["SGLANG_FLASHMEMORY_CPU"] == "1" and envs["SGLANG_USE_CPU_ENGINE"] == "1"
    assert envs["SGLANG_FP8_PAGED_MQA_LOGITS_TORCH"] == "1" and envs["SGLANG_OPT_FLASHMLA_SPARSE_PREFILL"] == "0"
    assert ns.model_path.endswith("checkpoints/tiny-dsv4-sglang")
    if script != "data_generation/start_dump_server.sh":
        assert envs["SGLANG_OPT_USE_ONLINE_COMPRESS"] == "0"  # the CUDA planner's path; 1 on GPUs
    if script == "launch_decode.sh":
        assert envs["SGLANG_RETRIEVER_INLINE_CKPT"] == "" and envs["SGLANG_RETRIEVER_INLINE_LAYERS"] == "0,1"
        assert ns.max_running_requests == 4
        # D keeps a busy CPU P (minutes per long prefill) instead of dropping it after two missed 3-s heartbeats
        assert int(envs["SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"]) >= 60


def test_cpu_router_waits_for_slow_workers():
    from sglang_router.launch_router import parse_router_args

    argv, _ = command("launch_router.sh", DEVICE="cpu")
    ra = parse_router_args(argv[3:])
    assert ra.health_check_timeout_secs == 120 and ra.disable_circuit_breaker
    argv, _ = command("launch_router.sh")
    assert not parse_router_args(argv[3:]).disable_circuit_breaker


def test_cpu_refuses_cuda_graph():
    p = dry("launch_decode.sh", DEVICE="cpu", CUDA_GRAPH="1")
    assert p.returncode != 0 and "CUDA_GRAPH=1 with DEVICE=cpu" in p.stderr


def test_mooncake_tcp_is_a_backend_sglang_accepts(sg):
    """sglang 0.5.23 itself maps mooncake_tcp to mooncake with MC_FORCE_TCP=1 (pd_disaggregation_hook.py:30)."""
    for script in ("launch_prefill.sh", "launch_decode.sh"):
        argv, _ = command(script, TRANSFER_BACKEND="mooncake_tcp")
        p = argparse.ArgumentParser()
        sg["server_args"].ServerArgs.add_cli_args(p)
        assert p.parse_args(argv[3:]).disaggregation_transfer_backend == "mooncake_tcp"


@pytest.mark.parametrize(
    "backend,device,advice",
    [
        ("nixl", "cuda", "pip install -e '.[serve-nixl]'"),
        ("mooncake", "cuda", "pip install -e '.[serve-mooncake]'"),
        ("mooncake_tcp", "cpu", "pip install -e '.[serve-mooncake-cpu]' and the OS package libibverbs1"),
    ],
)
def test_transfer_backend_that_does_not_import_names_its_extra(tmp_path, backend, device, advice):
    """A backend whose import fails (here: a stand-in python that fails `import nixl._api` / `mooncake.engine`
    like a missing shared library) stops the script with the extra that installs it, before sglang starts."""
    import sys

    fake = tmp_path / "python"
    fake.write_text(
        '#!/bin/sh\ncase "$*" in *"import nixl"*|*"import mooncake"*) '
        'echo "ImportError: libibverbs.so.1: cannot open shared object file" >&2; exit 1;; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    e = {**os.environ, "PYTHON": str(fake), "MODEL": str(tmp_path), "TRANSFER_BACKEND": backend, "DEVICE": device}
    e.pop("DRY_RUN", None)
    p = subprocess.run(
        ["bash", os.path.join(ROOT, "launch_prefill.sh")], env=e, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2, p.stderr
    assert advice in p.stderr and "libibverbs.so.1" in p.stderr and f"TRANSFER_BACKEND={backend}" in p.stderr


def test_extras_name_every_transfer_backend():
    """The advice is true: pyproject has one extra per backend the scripts accept."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert any(d.startswith("nixl") for d in extras["serve-nixl"])
    assert any(d.startswith("mooncake-transfer-engine=") for d in extras["serve-mooncake"])
    assert any(d.startswith("mooncake-transfer-engine-non-cuda") for d in extras["serve-mooncake-cpu"])
    assert any(d.startswith("sglang==") for d in extras["serve"])


def test_missing_model_is_error_without_dry_run():
    e = {**os.environ, "MODEL": "/nonexistent/model"}
    e.pop("DRY_RUN", None)
    p = subprocess.run(["bash", os.path.join(ROOT, "launch_prefill.sh")], env=e, capture_output=True, text=True)
    assert p.returncode != 0 and "/nonexistent/model does not exist" in p.stderr
    assert "does not exist" in dry("launch_prefill.sh", MODEL="/nonexistent/model").stderr  # warning only


def test_gpu_check_syntax_and_dry_run():
    assert subprocess.run(["bash", "-n", os.path.join(ROOT, "scripts/gpu_check.sh")]).returncode == 0
    p = dry("scripts/gpu_check.sh")
    assert p.returncode == 0 and "case r10" in p.stdout


def test_dump_server_writes_only_under_its_root_and_listens_locally():
    argv, envs = command("data_generation/start_dump_server.sh", DUMP_ROOT="/data/dumps")
    assert envs["SGLANG_FLASHMEMORY_DUMP_ROOT"] == "/data/dumps"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"  # this machine only, unless told
    from flashmemory.env import FlashMemoryEnv

    assert FlashMemoryEnv.from_environ(envs).dump_root == "/data/dumps"
    p = dry("data_generation/start_dump_server.sh", HOST="0.0.0.0")
    assert p.returncode == 0 and "accepts requests from the network" in p.stderr
    for root, msg in [
        ("", "DUMP_ROOT is not set"),
        ("rel/dir", "must be an absolute path"),
        ("/data/../etc", "must not contain '..'"),
    ]:
        p = dry("data_generation/start_dump_server.sh", DUMP_ROOT=root)
        assert p.returncode != 0 and msg in p.stderr and "CMD" not in p.stdout


def test_hisparse_decode_through_the_launch_script(sg, tmp_path):
    """`flashmemory serve --hisparse`: the project's D command, stock (FLASHMEMORY=0), Mooncake, and HiSparse's
    flags passed through launch_decode.sh's extra arguments; sglang's own parser reads them."""
    import json as _json

    pytest.importorskip("mooncake.engine", reason="HiSparse's PD path moves KV with Mooncake")
    from flashmemory.serve.stack import PDConfig, _env, hisparse_config

    cfg = hisparse_config(PDConfig(model=tmp_path))
    assert not cfg.flashmemory and cfg.transfer_backend == "mooncake"
    assert cfg.decode_env["SGLANG_PLUGINS"] == "flashmemory_cpu" and cfg.prefill_env["MOONCAKE_PROTOCOL"] == "tcp"
    env = {
        **_env(cfg, PORT="1", FLASHMEMORY="0", TRANSFER_BACKEND="mooncake", BOOTSTRAP_PORT="2", **dict(cfg.decode_env)),
        "DRY_RUN": "1",
    }
    out = subprocess.run(
        ["bash", os.path.join(ROOT, "launch_decode.sh"), *cfg.decode_args],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    argv = shlex.split([ln for ln in out.splitlines() if ln.startswith("CMD ")][0][4:])
    p = argparse.ArgumentParser()
    sg["server_args"].ServerArgs.add_cli_args(p)
    ns = p.parse_args(argv[3:])
    assert ns.enable_hisparse and ns.disable_radix_cache and ns.disaggregation_transfer_backend == "mooncake"
    assert _json.loads(ns.hisparse_config) == {"top_k": 512, "device_buffer_size": 512}
    assert "ENV SGLANG_DECODE_SWAP_P=0" in out and "ENV SGLANG_RETRIEVER_INLINE_CKPT=''" in out
