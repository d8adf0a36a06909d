"""The README and the hand-written pages under docs/ name only commands, flags, variables, paths and `make` targets
that exist (`tests.docs.doccheck`), and the checker fails when one of them goes missing."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tests.docs.doccheck import ROOT, Project, check

# Hand-written pages; docs/tiny-dsv4/ and docs/quality/ hold reports that commands write.
PAGES = [
    "README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "gpu").glob("*.md")),
]


@pytest.fixture(scope="module")
def project() -> Project:
    return Project.load()


@pytest.fixture(scope="module")
def readme() -> str:
    return (ROOT / "README.md").read_text()


@pytest.mark.parametrize("page", PAGES)
def test_page_names_only_what_exists(page: str, project: Project) -> None:
    text = (ROOT / page).read_text()
    problems = check(text, project, str(Path(page).parent), strict_env=page == "README.md")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES)
def test_page_describes_the_project_not_its_history(page: str) -> None:
    """No project issue numbers: a page says what the project is and does, not how it got there."""
    assert not re.findall(r"\b[Ii]ssues? \d+", (ROOT / page).read_text())


def test_code_describes_itself_not_its_history() -> None:
    """No project issue numbers in the package, the scripts or the tests: comments and docstrings say what the code
    is and why (upstream and sglang references such as PR or issue links keep their own form: `#<n>`)."""
    found = [
        f"{f.relative_to(ROOT)}:{i}"
        for d in ("flashmemory", "scripts", "tests", "training", "data_generation")
        for f in sorted((ROOT / d).rglob("*.py"))
        if f != Path(__file__).resolve()
        for i, ln in enumerate(f.read_text().splitlines(), 1)
        if re.search(r"\b[Ii]ssues? \d+", ln)
    ]
    assert not found, found


def test_readme_is_a_short_guide(readme: str) -> None:
    lines = readme.splitlines()
    assert len(lines) <= 250, len(lines)
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [ln.split("#")[0].strip() for ln in first_block[:2]] == ["make demo", "make test"]
    for section in ("## Requirements", "## Glossary", "## Troubleshooting", "## License", "## Metrics", "## Knobs"):
        assert section in readme, section


def _problems(text: str, project: Project) -> list[str]:
    return check(text, project, "", strict_env=True)


def test_a_missing_flag_is_caught(readme: str, project: Project) -> None:
    assert "flashmemory bench peers --contexts" in readme
    assert any("has no flag --kontexts" in p for p in _problems(readme.replace("--contexts", "--kontexts"), project))


def test_a_missing_subcommand_is_caught(readme: str, project: Project) -> None:
    bad = readme.replace("flashmemory checkpoint download", "flashmemory checkpoint fetch")
    assert any("no such subcommand" in p for p in _problems(bad, project))


def test_a_missing_variable_is_caught(readme: str, project: Project) -> None:
    assert not any("SGLANG_PATHP_PAGE_KMAX" in p for p in _problems(readme, project))
    gone = dataclasses.replace(project, env_vars=project.env_vars - {"SGLANG_PATHP_PAGE_KMAX"})
    assert any("SGLANG_PATHP_PAGE_KMAX" in p for p in _problems(readme, gone))


def test_a_missing_path_is_caught(readme: str, project: Project) -> None:
    gone = dataclasses.replace(project, exists=lambda p: p != "launch_router.sh" and project.exists(p))
    assert any("launch_router.sh" in p for p in _problems(readme, gone))
    gone = dataclasses.replace(project, exists=lambda p: p != "docs/serving.md" and project.exists(p))
    assert any("docs/serving.md" in p for p in _problems(readme, gone))


def test_a_missing_make_target_is_caught(readme: str, project: Project) -> None:
    gone = dataclasses.replace(project, make_targets=project.make_targets - {"serve"})
    assert any("make target serve" in p for p in _problems(readme, gone))


def test_a_knob_the_script_does_not_read_is_caught(readme: str, project: Project) -> None:
    bad = readme.replace("HOST=0.0.0.0 bash launch_router.sh", "HOSTNAME=0.0.0.0 bash launch_router.sh")
    assert bad != readme
    assert any("does not read HOSTNAME" in p for p in _problems(bad, project))


# (page, the startup-log line as the page quotes it, the format string the code logs it with, the file)
LOG_LINES = [
    (
        "docs/serving.md",
        "`FlashMemory Path-P (shrink mode): <n> c4 layers, <n> pool pages, reserve <n> blocks/layer, "
        "KMAX <n>, retriever <path>`",
        "FlashMemory Path-P (%s mode): %d c4 layers, %d pool pages, reserve %d blocks/layer, KMAX %d, ",
        "flashmemory/sglang/decode/adapter_factory.py",
    ),
    (
        "docs/serving.md",
        "`FlashMemory Path-P shrink: device c4 KV <x> GiB -> reserve <y> GiB",
        "FlashMemory Path-P shrink: device c4 KV %.2f GiB -> reserve %.2f GiB (%d blocks/layer incl. ",
        "flashmemory/sglang/decode/shrink_adapter.py",
    ),
    (
        "docs/disk-tier.md",
        "`disk tier (rank r): N pages of B B on disk at PATH (.. GB, O_DIRECT|buffered), host cache M pages (.. GB)",
        "disk tier (rank %d): %d pages of %d B on disk at %s (%.3g GB, %s), host cache %d pages (%.3g GB)%s",
        "flashmemory/offload/disk/__init__.py",
    ),
]


@pytest.mark.parametrize("page,quoted,fmt,source", LOG_LINES)
def test_quoted_startup_lines_are_the_ones_logged(page: str, quoted: str, fmt: str, source: str) -> None:
    assert " ".join(quoted.split()) in " ".join((ROOT / page).read_text().split()), (page, quoted)
    joined = re.sub(r'"\s*\n\s*"', "", (ROOT / source).read_text())  # adjacent string literals, as Python joins them
    assert fmt in joined, (source, fmt)


def _decode_env(device: str) -> dict[str, str]:
    """The variables `launch_decode.sh` exports (its DRY_RUN ENV lines) for DEVICE=device."""
    import os
    import shlex
    import subprocess

    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SGLANG_", "FLASHMEMORY"))
        and k not in ("KMAX", "CKPT", "INTERVAL", "SCORE_RESIDENT", "INDEX_K_OFFLOAD", "CUDA_GRAPH", "DEVICE", "MODEL")
    }
    p = subprocess.run(
        ["bash", str(ROOT / "launch_decode.sh")],
        env={**base, "DRY_RUN": "1", "DEVICE": device},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    return {
        k: (shlex.split(v) or [""])[0]
        for k, v in (ln[4:].split("=", 1) for ln in p.stdout.splitlines() if ln.startswith("ENV "))
    }


def knob_mismatches(readme: str, envs: dict[str, dict[str, str]]) -> list[tuple[str, str, str, str]]:
    """(variable, device, value launch_decode.sh sets, value the README states) for each row of the README's knob
    table that disagrees; a variable the script does not set keeps flashmemory/env_doc.py's default."""
    from flashmemory.env_doc import ENV_DOC

    section = readme.split("## Knobs", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([A-Z0-9_]+)`[^|]*\| ([^|]+) \|", section, flags=re.M)
    assert len(rows) >= 8, rows
    bad = []
    for var, cell in rows:
        stated = ["" if part.strip() == "empty" else part.strip().strip("`") for part in cell.split(" / ")]
        for device, want in (("cuda", stated[0]), ("cpu", stated[-1])):
            got = envs[device].get(var, ENV_DOC[var][0])
            if not (got == want or (want and got.endswith("/" + want))):
                bad.append((var, device, got, want))
    return bad


@pytest.fixture(scope="module")
def decode_envs() -> dict[str, dict[str, str]]:
    return {d: _decode_env(d) for d in ("cuda", "cpu")}


def test_readme_knob_defaults_are_what_launch_decode_sets(readme: str, decode_envs) -> None:
    assert knob_mismatches(readme, decode_envs) == []


def test_a_stale_knob_default_is_caught(readme: str, decode_envs) -> None:
    bad = readme.replace("| `96` / `16` |", "| `96` / `8` |")
    assert bad != readme
    assert knob_mismatches(bad, decode_envs) == [("SGLANG_PATHP_PAGE_KMAX", "cpu", "16", "8")]
