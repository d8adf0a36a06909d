"""Checks that what a Markdown page tells a reader to run exists: a test helper, not part of the package.

`check(text, project, doc_dir)` returns one line per problem (empty: the page is honest). It reads:
- every shell command of the page's ```bash/sh code blocks (continuation lines joined, comments dropped, split at
  `&&`, `||`, `;`, `|`), and every inline code span that starts with `flashmemory`, `.venv/bin/flashmemory`,
  `make` or `[KNOB=value ...] bash SCRIPT.sh`;
- `flashmemory <sub> ... --flag`: the subcommand chain must exist in the CLI's parser (built in-process, nothing
  spawned) and every `--flag` must be an option of the innermost subcommand;
- `make [VAR=value] TARGET...`: every target is a rule of the Makefile;
- `bash SCRIPT` / `python SCRIPT` / `python -m MODULE`: the script exists / the module can be found; `VAR=value`
  knobs before a launch script must be read by that script (or `scripts/launch_common.sh`);
- every `SGLANG_*` / `FLASHMEMORY_*` name in the page: one the env modules read (`flashmemory/env.py` and its
  `env_*` parts: `env_readers`; `strict_env`), or else one
  the project's sources or scripts mention (sglang's own switches that the launch scripts set);
- repository paths in inline code and Markdown links: they exist (generated outputs and downloads excluded).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Programs a page may name whose arguments are not the project's to check.
FOREIGN = {
    "pip",
    "curl",
    "git",
    "cd",
    "sudo",
    "apt-get",
    "export",
    "hf",
    "nvidia-smi",
    "ps",
    "ss",
    "grep",
    "kill",
    "echo",
    "cat",
    "ls",
    "tail",
    "sleep",
    "mkdir",
    "df",
    "free",
    "nproc",
    "watch",
    "jq",
    "diff",
    "head",
    "wc",
}
TRACKED_TOP = ("docs", "scripts", "flashmemory", "tests", "training", "data_generation")
GENERATED = ("docs/gpu/results.",)  # written by the GPU check the pages name, not in the tree before it runs
ENV_RE = re.compile(r"\b((?:SGLANG|FLASHMEMORY)_[A-Z0-9_]*[A-Z0-9])\b")
SEPARATORS = {"&&", "||", ";", "|"}
PROCESS_ENV = {"CUDA_VISIBLE_DEVICES"}  # read by CUDA in every process the scripts start, not by the scripts


def env_readers(root: Path) -> list[Path]:
    """The modules that read FlashMemory's environment: `flashmemory/env.py` and its `env_*.py` parts, less the
    meaning table (`env_doc.py`, which names every variable without reading one) and the launch check (`env_check.py`,
    which reads through env)."""
    return [p for p in sorted((root / "flashmemory").glob("env*.py")) if p.name not in ("env_doc.py", "env_check.py")]


@dataclass
class Project:
    """What the pages are checked against. Fields are plain data so a test can take something away."""

    root: Path
    make_targets: set[str]
    env_vars: set[str]  # names the env modules read (env_readers)
    mentioned: str  # the project's sources and scripts, for names the env modules do not read
    parser: Callable[[], argparse.ArgumentParser]
    exists: Callable[[str], bool] = field(default=lambda p: False)

    @classmethod
    def load(cls, root: Path = ROOT) -> "Project":
        from flashmemory.cli import build_parser

        make = (root / "Makefile").read_text()
        targets = set(re.findall(r"^([A-Za-z][\w-]*):", make, flags=re.M))
        env_src = "\n".join(p.read_text() for p in env_readers(root))
        env_vars = set(re.findall(r'"((?:SGLANG|FLASHMEMORY)_[A-Z0-9_]+)"', env_src))
        srcs = [
            *root.glob("*.sh"),
            *root.glob("scripts/*.sh"),
            *root.glob("data_generation/*.sh"),
            *root.glob("flashmemory/**/*.py"),
            *root.glob("scripts/**/*.py"),
        ]
        mentioned = "\n".join(p.read_text(errors="replace") for p in srcs)
        return cls(root, targets, env_vars, mentioned, build_parser, lambda p: (root / p).exists())


def code_blocks(text: str) -> list[str]:
    """Bodies of the fenced shell blocks (```bash, ```sh, ```shell or unlabelled)."""
    return [
        m.group(2)
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S)
        if m.group(1) in ("", "bash", "sh", "shell", "console")
    ]


def commands(block: str) -> list[list[str]]:
    """The block's commands as token lists: continuation lines joined, comments dropped, split at separators."""
    out: list[list[str]] = []
    for line in block.replace("\\\n", " ").splitlines():
        try:
            toks = shlex.split(line, comments=True)
        except ValueError:
            continue
        cur: list[str] = []
        for t in toks:
            if t in SEPARATORS:
                out.append(cur)
                cur = []
            else:
                cur.append(t)
        out.append(cur)
    return [c for c in out if c]


def _options(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def check_flashmemory(args: list[str], project: Project) -> list[str]:
    p, chain = project.parser(), ["flashmemory"]
    rest = [a for a in args if a != "--debug"]
    while rest and _subparsers(p) and not rest[0].startswith("-"):
        subs = _subparsers(p)
        if rest[0] not in subs:
            return [f"`{' '.join(chain)} {rest[0]}`: no such subcommand (has: {', '.join(sorted(subs))})"]
        p = subs[rest[0]]
        chain.append(rest.pop(0))
    opts = _options(p)
    return [
        f"`{' '.join(chain)}` has no flag {flag}"
        for a in rest
        if a.startswith("--")
        for flag in [a.split("=", 1)[0]]
        if flag not in opts
    ]


def _path_problem(path: str, project: Project, what: str) -> list[str]:
    return [] if project.exists(path) else [f"{what} {path} does not exist"]


def check_command(toks: list[str], project: Project) -> list[str]:
    knobs = []
    while toks and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", toks[0]):
        knobs.append(toks.pop(0).split("=", 1)[0])
    if not toks:
        return []
    prog, args = toks[0], toks[1:]
    base = prog.rsplit("/", 1)[-1]
    if base == "flashmemory":
        return check_flashmemory(args, project)
    if base == "make":
        return [
            f"make target {t} is not in the Makefile"
            for t in args
            if not t.startswith("-") and "=" not in t and t not in project.make_targets
        ]
    if base in ("bash", "sh"):
        script = next((a for a in args if not a.startswith("-")), None)
        if script is None:
            return []
        if not project.exists(script):
            return [f"script {script} does not exist"]
        text = (project.root / script).read_text() + (project.root / "scripts" / "launch_common.sh").read_text()
        return [
            f"{script} does not read {k}"
            for k in knobs
            if not re.search(r"\$\{?" + k + r"\b", text) and not ENV_RE.fullmatch(k) and k not in PROCESS_ENV
        ]
    if base.startswith("python"):
        if args[:1] == ["-c"]:
            return []
        if args[:1] == ["-m"] and len(args) > 1:
            found = (
                importlib.util.find_spec(args[1].split(".")[0]) is not None
                and importlib.util.find_spec(args[1]) is not None
            )
            return [] if found else [f"python module {args[1]} cannot be found"]
        return _path_problem(args[0], project, "script") if args else []
    if prog.endswith(".sh"):
        return _path_problem(prog, project, "script")
    if base in FOREIGN:
        return []
    return [f"unknown program {prog!r} (add it to doccheck.FOREIGN if it is not ours)"]


def repo_paths(text: str) -> set[str]:
    """Repository paths named in inline code and relative Markdown links (anchors dropped)."""
    found = set()
    for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text):
        for tok in span.split():
            tok = tok.rstrip(".,:;)").split(":", 1)[0]
            if tok.split("/", 1)[0] in TRACKED_TOP and "/" in tok and not re.search(r"[<>*{}$\[\]]|\.\.\.", tok):
                found.add(tok.rstrip("/"))
    return found


def links(text: str) -> list[str]:
    return [m for m in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", m) and not m.startswith("#")]


def check(text: str, project: Project, doc_dir: str = "", strict_env: bool = True) -> list[str]:
    """Every problem of one page, one line each; `doc_dir` is the page's folder relative to the root."""
    problems: list[str] = []
    for block in code_blocks(text):
        for cmd in commands(block):
            problems += check_command(list(cmd), project)
    spans = r"(?<!`)`((?:\.venv/bin/)?flashmemory [^`\n]+|make [a-z][^`\n]*|(?:[A-Z_]+=\S* )*bash \S+\.sh[^`\n]*)`(?!`)"
    for span in re.findall(spans, text):
        try:
            toks = shlex.split(span)
        except ValueError:
            continue
        if not any(re.search(r"[<>\[\]|]|\.\.\.", t) for t in toks):
            problems += check_command(toks, project)
    for name in sorted(set(ENV_RE.findall(text))):
        if name not in project.env_vars and (strict_env or name not in project.mentioned):
            problems.append(f"environment variable {name} is not one flashmemory/env.py (or its env_* parts) reads")
    for path in sorted(repo_paths(text)):
        if not path.startswith(GENERATED):
            problems += _path_problem(path, project, "path")
    for link in links(text):
        target = os.path.normpath(os.path.join(doc_dir, link.split("#", 1)[0])) if link.split("#", 1)[0] else ""
        if target and not target.startswith(GENERATED):
            problems += _path_problem(target, project, "link target")
    return problems
