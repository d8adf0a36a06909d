"""The gate table of `flashmemory/sglang/README.md`, generated from `flashmemory.env.ENV_DOC`.

`python -m flashmemory.sglang.gates` prints it; a test checks the README holds exactly this text.
"""

from __future__ import annotations

from flashmemory.env import ENV_DOC

BEGIN = "<!-- BEGIN GATE TABLE (python -m flashmemory.sglang.gates) -->"
END = "<!-- END GATE TABLE -->"


def gate_table() -> str:
    lines = [BEGIN, "| Variable | Default | Meaning |", "|---|---|---|"]
    for name, (default, meaning) in ENV_DOC.items():
        shown = f"`{default}`" if default != "" else "(empty)"
        lines.append(f"| `{name}` | {shown} | {meaning.replace('|', '/')} |")
    lines.append(END)
    return "\n".join(lines)


if __name__ == "__main__":
    print(gate_table())
