#!/usr/bin/env bash
# PD router; start it last (after D and P). Clients call http://<router>:31503/v1/chat/completions.
# HOST (default 127.0.0.1: this machine only; HOST=0.0.0.0 opens the router and its metrics port to the network)
# Knobs (env): PREFILL_IP PREFILL_PORT DECODE_IP DECODE_PORT BOOTSTRAP_PORT HOST PORT PROMETHEUS_PORT PYTHON
#   DEVICE (cuda; cpu: workers answer slowly, so health checks wait 120 s and the circuit breaker is off)
#   MINI_LB=1 uses sglang_router's Python MiniLoadBalancer instead of the Rust router.  DRY_RUN=1 prints.
set -euo pipefail
FM_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$FM_REPO/scripts/launch_common.sh"

PREFILL_IP="${PREFILL_IP:-127.0.0.1}"; PREFILL_PORT="${PREFILL_PORT:-31100}"
DECODE_IP="${DECODE_IP:-127.0.0.1}"; DECODE_PORT="${DECODE_PORT:-31200}"; BOOTSTRAP_PORT="${BOOTSTRAP_PORT:-8998}"
HOST="${HOST:-127.0.0.1}"; PORT="${PORT:-31503}"; MINI_LB="${MINI_LB:-0}"; PROMETHEUS_PORT="${PROMETHEUS_PORT:-29000}"
DEVICE="${DEVICE:-cuda}"; fm_choice DEVICE "$DEVICE" cuda cpu
HC=(); [[ "$DEVICE" == cuda ]] || HC=(--health-check-timeout-secs 120 --disable-circuit-breaker)
fm_int PREFILL_PORT "$PREFILL_PORT" 1; fm_int DECODE_PORT "$DECODE_PORT" 1; fm_int BOOTSTRAP_PORT "$BOOTSTRAP_PORT" 1
fm_int PORT "$PORT" 1; fm_int PROMETHEUS_PORT "$PROMETHEUS_PORT" 1; fm_flag MINI_LB
[[ -n "$PREFILL_IP" && -n "$DECODE_IP" ]] || fm_die "PREFILL_IP and DECODE_IP must be set"
PY="$(fm_python)"
fm_module "$PY" sglang_router
LB=(); [[ "$MINI_LB" == 0 ]] || LB=(--mini-lb)

fm_run -- "$PY" -m sglang_router.launch_router --pd-disaggregation "${LB[@]}" \
  --prefill "http://$PREFILL_IP:$PREFILL_PORT" "$BOOTSTRAP_PORT" --decode "http://$DECODE_IP:$DECODE_PORT" \
  --request-timeout-secs 14400 "${HC[@]}" --host "$HOST" --port "$PORT" --prometheus-host "$HOST" --prometheus-port "$PROMETHEUS_PORT"
