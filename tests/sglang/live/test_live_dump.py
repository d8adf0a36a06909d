"""Live dump on CPU: data_generation/start_dump_server.sh with DEVICE=cpu (a real sglang server with
the plugin in dump mode), data_generation/run_dump_training_data.py against it, then `flashmemory verify` of the
written documents against the transformers engine on the same weights, then training on them.

One server, module-scoped, in its own process group; killed on success and on failure, and checked gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.sglang]
pytest.importorskip("sglang")

from flashmemory.serve.procs import Servers, free_ports  # noqa: E402
from flashmemory.serve.stack import DEFAULT_CPU_MODEL, REPO, PDConfig, _env, ensure_model  # noqa: E402

# ~300 bytes each (the served tokenizer is byte-level): ~75 c4 chunks, so the logit correlation has real support
PROMPTS = [
    "Remember this: the key for the blue door is 7431, the key for the red door is 2290, and the key for the "
    "green door is 5518. The blue door leads to the garden, the red door to the cellar and the green door to "
    "the attic. Now repeat the key for the red door and say where that door leads, in one short sentence.",
    "Here is a list of colours seen on a walk: crimson, teal, ochre, violet, amber, slate, coral, olive, navy "
    "and ivory. Some were on houses, some on cars and some on flowers by the road. List the first three "
    "colours from the walk in the order they were seen, and nothing else at all please.",
]
MAX_TOKENS = 12


def _run(argv: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    return subprocess.run(argv, cwd=str(REPO), env=e, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    """Start the dump server, dump PROMPTS through it, stop it; the dump directory (docs + metadata)."""
    model = ensure_model(DEFAULT_CPU_MODEL)
    root = tmp_path_factory.mktemp("live_dump")
    inp = root / "in.jsonl"
    inp.write_text(
        "".join(json.dumps({"prompt": json.dumps([{"role": "user", "content": p}])}) + "\n" for p in PROMPTS)
    )
    out = root / "dump"
    port = free_ports(1)[0]
    servers = Servers(root / "logs")
    try:
        srv = servers.start(
            "dump_server",
            ["bash", str(REPO / "data_generation" / "start_dump_server.sh")],
            _env(PDConfig(model=model), PORT=str(port), DUMP_ROOT=str(root)),
        )
        startup = servers.wait_http(srv, f"http://127.0.0.1:{port}/health", 600)
        t = time.monotonic()
        p = _run(
            [
                sys.executable,
                "data_generation/run_dump_training_data.py",
                "--backend",
                "sglang",
                "--url",
                f"http://127.0.0.1:{port}/v1",
                "--model",
                str(model),
                "--input",
                str(inp),
                "--output-dir",
                str(out),
                "--target-csa-layers",
                "0",
                "1",
                "--min-layers",
                "2",
                "--max-tokens",
                str(MAX_TOKENS),
                "--concurrency",
                "2",
                "--no-progress",
            ],
            timeout=900,
        )
        print(f"\ndump server: startup {startup:.0f} s, dump of {len(PROMPTS)} prompts {time.monotonic() - t:.0f} s")
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        # on the live server: a client naming an output dir outside the server's root is refused
        outside = tmp_path_factory.mktemp("outside_root") / "dump"
        refused = _run(
            [
                sys.executable,
                "data_generation/run_dump_training_data.py",
                "--backend",
                "sglang",
                "--url",
                f"http://127.0.0.1:{port}/v1",
                "--model",
                str(model),
                "--input",
                str(inp),
                "--output-dir",
                str(outside),
                "--target-csa-layers",
                "0",
                "1",
                "--min-layers",
                "2",
                "--max-tokens",
                "2",
                "--n-samples",
                "1",
                "--no-progress",
            ],
            timeout=600,
        )
    finally:
        servers.stop()
    assert servers.leftovers() == []
    return out, model, refused, outside


def test_dump_writes_docs(dump_dir):
    from flashmemory.dump import list_docs, load_doc

    out = dump_dir[0]
    docs = list_docs(str(out))
    assert len(docs) == len(PROMPTS)
    doc = load_doc(docs[0])
    assert doc.labels.indices.numel() > 0


def test_verify_passes_against_the_transformers_engine(dump_dir):
    out, model = dump_dir[:2]
    # --fp8-q: sglang's indexer quantizes q to fp8 per head (the CPU layer does the same), so the reference does too
    p = _run(
        [
            sys.executable,
            "-m",
            "flashmemory.cli",
            "verify",
            "--dump",
            str(out),
            "--model",
            str(model),
            "--max-docs",
            str(len(PROMPTS)),
            "--fp8-q",
        ],
        timeout=600,
    )
    print(p.stdout[-2000:])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def test_training_runs_on_the_live_dump(dump_dir, tmp_path):
    out = dump_dir[0]
    cfg = tmp_path / "data.json"
    cfg.write_text(json.dumps({"train": [{"data_dir": str(out)}], "val": [{"data_dir": str(out)}]}))
    p = _run(
        [
            sys.executable,
            "-m",
            "flashmemory.cli",
            "train",
            "--data-config",
            str(cfg),
            "--output-dir",
            str(tmp_path / "ckpt"),
            "--no-pretrain",
            "--epochs",
            "1",
            "--joint-layers",
            "0,1",
            "--n-heads",
            "4",
            "--q-lora-rank",
            "16",
            "--batch-size",
            "4",
            "--device",
            "cpu",
            "--label-interval",
            "4",
        ],
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert any((tmp_path / "ckpt").glob("*.safetensors")) or any((tmp_path / "ckpt").glob("*.pt"))


def test_a_dump_outside_the_server_root_is_refused(dump_dir):
    _, _, refused, outside = dump_dir
    text = refused.stdout + refused.stderr
    assert refused.returncode != 0, text[-3000:]
    assert not list(outside.glob("doc_*")), "the server wrote outside its dump root"
    assert "root" in text, text[-3000:]  # the server's reason reaches the client
