#!/usr/bin/env python3
"""Upstream-compatible entry point: the same flags as `flashmemory dump` (see data_generation/README.md).

    python data_generation/run_dump_training_data.py --input data.jsonl --output-dir /abs/out --backend sglang
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from flashmemory.dump.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
