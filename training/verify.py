#!/usr/bin/env python3
"""Thin wrapper: `python training/verify.py ARGS` == `flashmemory verify ARGS`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashmemory.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["verify", *sys.argv[1:]]))
