"""`verify` with another seed than the dump's said only "FAIL: min r". A dump now records its
model and seed (metadata lines; additive), and verify refuses a seed the dump was not made with, naming the
flag and the dump's value; a FAIL on an older dump without them says what to check."""

import json
from pathlib import Path

import pytest

from flashmemory.cli import main
from flashmemory.dump import read_metadata

EXAMPLE = Path(__file__).resolve().parents[2] / "data_generation" / "example_data" / "tiny_chat.jsonl"


@pytest.fixture(scope="module")
def seeded_dump(tmp_path_factory):
    d = tmp_path_factory.mktemp("seeded") / "dump"
    assert (
        main(
            [
                "dump",
                "--input",
                str(EXAMPLE),
                "--output-dir",
                str(d),
                "--model",
                "micro",
                "--seed",
                "3",
                "--max-tokens",
                "6",
                "--n-samples",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    return d


def test_the_dump_records_its_model_and_seed(seeded_dump):
    """Promise (README "Errors and data safety"): the error names the flag, which needs the dump to say how it
    was made; the fields are additive (older readers ignore them)."""
    (rec,) = read_metadata(seeded_dump)
    assert (rec["model"], rec["seed"], rec["backend"]) == ("micro", 3, "hf")


def test_verify_with_another_seed_says_why(seeded_dump, capsys):
    """Promise: "One line, non-zero exit" naming the flag: `verify --seed 0` on a `--seed 3` dump used to print
    only "FAIL: min r = ..." (exit 1), as if the math were wrong."""
    assert main(["verify", "--dump", str(seeded_dump), "--model", "micro"]) == 2
    out = capsys.readouterr()
    assert out.err.strip().splitlines() == [
        f"flashmemory verify: error: --seed 0: the dump {seeded_dump} was made with --model micro --seed 3 "
        "(server_metadata.jsonl); its native logits come from that random model, so pass --seed 3"
    ]
    assert "FAIL" not in out.out
    assert main(["verify", "--dump", str(seeded_dump), "--model", "micro", "--seed", "3"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_a_fail_on_a_dump_without_a_recorded_seed_says_what_to_check(seeded_dump, tmp_path, capsys):
    """Promise as above, for older dumps (no `seed` in the metadata): verify still runs (backward compatible),
    and its FAIL line says the dump records no seed."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(seeded_dump, old)
    meta = old / "server_metadata.jsonl"
    recs = [json.loads(x) for x in meta.read_text().splitlines()]
    meta.write_text(
        "".join(json.dumps({k: v for k, v in r.items() if k not in ("model", "seed")}) + "\n" for r in recs)
    )
    assert main(["verify", "--dump", str(old), "--model", "micro"]) == 1
    fail = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("FAIL")]
    assert len(fail) == 1 and "the dump records no model/seed" in fail[0] and "--seed" in fail[0]


def test_verify_seed_out_of_range_names_the_flag(seeded_dump, capsys):
    """Promise: "Every numeric input is range-checked where it is read"."""
    assert main(["verify", "--dump", str(seeded_dump), "--model", "micro", "--seed", str(2**70)]) == 2
    assert f"--seed {2**70} must lie in [0, {2**63 - 1}]" in capsys.readouterr().err
