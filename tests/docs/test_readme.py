"""The README and the hand-written pages under docs/ name only commands, flags, variables, paths and `make` targets
that exist (`tests.docs.doccheck`), and the checker fails when one of them goes missing."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tests.docs.doccheck import ROOT, Project, check

# Hand-written pages; docs/tiny-dsv4/ and docs/quality/ hold reports that commands write.
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
         *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "gpu").glob("*.md"))]


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
    ("docs/serving.md", "`FlashMemory Path-P (shrink mode): <n> c4 layers, <n> pool pages, reserve <n> blocks/layer, "
     "KMAX <n>, retriever <path>`", "FlashMemory Path-P (%s mode): %d c4 layers, %d pool pages, reserve %d "
     "blocks/layer, KMAX %d, ", "flashmemory/sglang/adapter_factory.py"),
    ("docs/serving.md", "`FlashMemory Path-P shrink: device c4 KV <x> GiB -> reserve <y> GiB",
     "FlashMemory Path-P shrink: device c4 KV %.2f GiB -> reserve %.2f GiB (%d blocks/layer incl. ",
     "flashmemory/sglang/shrink.py"),
    ("docs/disk-tier.md", "`disk tier (rank r): N pages of B B on disk at PATH (.. GB, O_DIRECT|buffered), host cache "
     "M pages (.. GB)", "disk tier (rank %d): %d pages of %d B on disk at %s (%.3g GB, %s), host cache %d pages "
     "(%.3g GB)%s", "flashmemory/offload/disk/__init__.py"),
]


@pytest.mark.parametrize("page,quoted,fmt,source", LOG_LINES)
def test_quoted_startup_lines_are_the_ones_logged(page: str, quoted: str, fmt: str, source: str) -> None:
    assert " ".join(quoted.split()) in " ".join((ROOT / page).read_text().split()), (page, quoted)
    joined = re.sub(r'"\s*\n\s*"', "", (ROOT / source).read_text())   # adjacent string literals, as Python joins them
    assert fmt in joined, (source, fmt)
