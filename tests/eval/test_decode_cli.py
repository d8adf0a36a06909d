"""`flashmemory eval --decode` argument checks (the harness itself runs in tests/demo)."""

import pytest

from flashmemory.cli import main


@pytest.mark.parametrize(
    "extra, msg",
    [
        ([], "--tasks"),
        (["--tasks", "TASKS", "--budget", "0"], "budget"),
        (["--tasks", "TASKS", "--budget", "2"], "budget"),
        (["--tasks", "TASKS", "--methods", "FlashMemory,Bogus"], "unknown method"),
    ],
)
def test_bad_decode_arguments(tmp_path, capsys, extra, msg):
    from flashmemory.retriever import JointRetriever, RetrieverDims, save_retriever
    from flashmemory.tasks.suite import generate, write_jsonl

    ckpt = save_retriever(
        JointRetriever((1, 2, 3), RetrieverDims(hidden=64, rank=8, n_heads=2, head_dim=32, rope_dim=16)),
        tmp_path / "r.safetensors",
    )
    tasks = tmp_path / "t.jsonl"
    write_jsonl(generate("niah_single", 128, n=1), str(tasks))
    argv = ["eval", "--decode", "--model", "micro", "--checkpoint", str(ckpt)]
    argv += [str(tasks) if x == "TASKS" else x for x in extra]
    assert main(argv) == 2
    assert msg in capsys.readouterr().err


def test_plain_eval_needs_a_dump(capsys):
    assert main(["eval", "--checkpoint", "x.safetensors"]) == 2
    assert "--dump" in capsys.readouterr().err
