#!/usr/bin/env bash
# One-GPU check of the package's own device code, WITHOUT sglang (scripts/gpu_core_check.py): for the lent H200,
# whose image has torch 2.11 and no sglang. At most 8 minutes; installs nothing; runs on the image's python3
# (PYTHON=... to choose another). Arguments go to the script (e.g. --only a,b or --device cpu --quick).
# Results: docs/gpu/results.{json,md} (or --out); with $OUT set (the device tool returns that folder) the
# results and the log are copied there. Exit status: the script's (1 = a correctness check failed, 124 = timeout).
# For a machine WITH sglang, scripts/gpu_check.sh checks the plugin inside a real sglang server instead.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="${OUT:-${TMPDIR:-/tmp}}/gpu_core_check.log"
timeout 480 "$PY" scripts/gpu_core_check.py "$@" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
if [[ -n "${OUT:-}" ]]; then
  res="docs/gpu"
  for ((i = 1; i <= $#; i++)); do [[ "${!i}" == "--out" ]] && { j=$((i + 1)); res="${!j}"; }; done
  cp -f "$res"/results.json "$res"/results.md "$OUT"/ 2>/dev/null || echo "gpu_core_check.sh: no results in $res"
fi
exit "$rc"
