#!/usr/bin/env bash
# One-H200 check of the FlashMemory sglang plugin (6-layer DSv4, --load-format dummy); at most 8 minutes,
# installs nothing. DRY_RUN=1 prints the plan only. Logs, results.json and summary.txt go to $OUT (the device
# tool returns that folder) or, without $OUT, to a temp dir. See scripts/gpu_check.py for the cases.
set -euo pipefail
FM_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$FM_REPO/.venv/bin/python"; [[ -x "$PY" ]] || PY=python3
export PYTHONPATH="$FM_REPO${PYTHONPATH:+:$PYTHONPATH}"
if [[ "${DRY_RUN:-0}" == 1 ]]; then exec "$PY" "$FM_REPO/scripts/gpu_check.py" --dry-run; fi
exec timeout 480 "$PY" "$FM_REPO/scripts/gpu_check.py" --case-timeout "${CASE_TIMEOUT:-110}"
