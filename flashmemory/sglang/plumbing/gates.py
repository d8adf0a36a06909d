"""The gate table of `docs/configuration.md`, generated from `flashmemory.env_doc.ENV_DOC`.

`python -m flashmemory.sglang.plumbing.gates` prints it; `... gates --write FILE...` replaces the table inside each
FILE in place; a test checks the page holds exactly this text.
"""

from __future__ import annotations

from flashmemory.env_doc import ENV_DOC

BEGIN = "<!-- BEGIN GATE TABLE (python -m flashmemory.sglang.plumbing.gates) -->"
END = "<!-- END GATE TABLE -->"


def gate_table() -> str:
    lines = [BEGIN, "| Variable | Default | Meaning |", "|---|---|---|"]
    for name, (default, meaning) in ENV_DOC.items():
        shown = f"`{default}`" if default != "" else "(empty)"
        lines.append(f"| `{name}` | {shown} | {meaning.replace('|', '/')} |")
    lines.append(END)
    return "\n".join(lines)


def write_table(path: str) -> None:
    """Replace the text between BEGIN and END (inclusive) in `path` with the current table."""
    text = open(path, encoding="utf-8").read()
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise SystemExit(f"{path}: no gate table markers ({BEGIN} ... {END})")
    with open(path, "w", encoding="utf-8") as f:
        f.write(head + gate_table() + tail)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--write"]:
        for p in sys.argv[2:]:
            write_table(p)
    else:
        print(gate_table())
