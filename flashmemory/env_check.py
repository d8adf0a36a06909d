"""`python -m flashmemory.env_check [--print] [NAME...]`: the plugin's own reading of the FlashMemory environment,
for the launch scripts (`scripts/launch_common.sh`, `fm_run`), so the shell and the plugin cannot disagree.

It parses the process environment exactly as the plugin does (`FlashMemoryEnv.from_environ`, the disk tier, the
diagnostic variables) and prints one line `error: <message>` on stderr for each bad variable: after an error it
sets the variable the message names first aside and parses again, so a second bad variable is named too. Exit 2
when any is bad, else 0. `--print` first prints `ENV NAME=value` (shell-quoted) for every FlashMemory variable
(`flashmemory.env_doc.ENV_DOC` and the diagnostic ones) set in the environment and not among the NAMEs given
(those the script prints itself).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence

from flashmemory.env import (
    FAULT_INJECT,
    HISPARSE_TRACE,
    LEVEL1_DELAY,
    STATS_FILE,
    EnvError,
    FlashMemoryEnv,
    fault_inject,
    hisparse_trace,
    level1_delay,
)
from flashmemory.env_doc import ENV_DOC

DIAGNOSTIC = (STATS_FILE, HISPARSE_TRACE, FAULT_INJECT, LEVEL1_DELAY)
NAMES: tuple[str, ...] = (*ENV_DOC, *DIAGNOSTIC)
_NAME_RE = re.compile(r"[A-Z][A-Z0-9_]+")


def named_variable(message: str, env: Mapping[str, str]) -> str | None:
    """The first FlashMemory variable set in `env` that `message` names (whole names only), or None."""
    for word in _NAME_RE.findall(message):
        if word in NAMES and word in env:
            return word
    return None


def _parse(env: Mapping[str, str]) -> None:
    FlashMemoryEnv.from_environ(env)
    hisparse_trace(env)
    fault_inject(env)
    level1_delay(env)


def check(env: Mapping[str, str]) -> list[str]:
    """One message per bad FlashMemory variable of `env` (empty: the plugin accepts it all)."""
    rest = {k: v for k, v in env.items() if k in NAMES}
    errors: list[str] = []
    for _ in range(len(rest) + 1):
        try:
            _parse(rest)
            return errors
        except EnvError as e:
            errors.append(" ".join(str(e).split()))
            name = named_variable(str(e), rest)
            if name is None:
                return errors
            del rest[name]
    return errors


def listing(env: Mapping[str, str], skip: Sequence[str] = ()) -> list[str]:
    """`ENV NAME=value` for each FlashMemory variable set in `env` and not in `skip`, in `NAMES` order."""
    return [f"ENV {n}={shlex.quote(env[n])}" for n in NAMES if n in env and n not in set(skip)]


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if env is None else env
    if args[:1] == ["--print"]:
        args = args[1:]
        for line in listing(env, args):
            print(line)
    errors = check(env)
    for msg in errors:
        print(f"error: {msg}", file=sys.stderr)
    return 2 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
