#!/usr/bin/env python3
"""Thin wrapper: `python training/train.py ARGS` == `flashmemory train ARGS` (also under torchrun)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashmemory.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
