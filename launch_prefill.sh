#!/usr/bin/env bash
# P server of the PD pair (stock sglang: FlashMemory gates off). Start it after D, before the router.
# Knobs (env): MODEL TP CTX_LEN SWA_RATIO (0.1; use 0.4 for 900K-1M prompts) MEM_FRAC MAX_RUN HOST PORT
#   TRANSFER_BACKEND(nixl|mooncake|mooncake_tcp) BOOTSTRAP_PORT DEVICE(cuda|cpu) PYTHON.  DRY_RUN=1 prints instead.
# DEVICE=cpu: sglang on CPU with the tiny model (tp 1, 4K context, 4 requests); see docs/serving.md, CPU serving.
set -euo pipefail
FM_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$FM_REPO/scripts/launch_common.sh"

DEVICE="${DEVICE:-cuda}"; fm_device_setup "$DEVICE"
if [[ "$DEVICE" == cpu ]]; then
  MODEL="${MODEL:-$FM_CPU_MODEL}"; TP="${TP:-1}"; CTX_LEN="${CTX_LEN:-4096}"; MAX_RUN="${MAX_RUN:-4}"
else
  MODEL="${MODEL:-/dockerdata/models/ds_fp8}"; TP="${TP:-8}"; CTX_LEN="${CTX_LEN:-1100000}"; MAX_RUN="${MAX_RUN:-48}"
fi
HOST="${HOST:-127.0.0.1}"   # this machine only; HOST=<this node's address> (or 0.0.0.0) opens it to the network
SWA_RATIO="${SWA_RATIO:-0.1}"; MEM_FRAC="${MEM_FRAC:-0.75}"; PORT="${PORT:-31100}"
TRANSFER_BACKEND="${TRANSFER_BACKEND:-nixl}"; BOOTSTRAP_PORT="${BOOTSTRAP_PORT:-8998}"

fm_int TP "$TP" 1; fm_int CTX_LEN "$CTX_LEN" 1; fm_int MAX_RUN "$MAX_RUN" 1; fm_int PORT "$PORT" 1
fm_int BOOTSTRAP_PORT "$BOOTSTRAP_PORT" 1; fm_float SWA_RATIO "$SWA_RATIO"; fm_float MEM_FRAC "$MEM_FRAC"; fm_local_only "$HOST"
fm_choice TRANSFER_BACKEND "$TRANSFER_BACKEND" nixl mooncake mooncake_tcp
PY="$(fm_python)"
fm_path "model path (MODEL)" "$MODEL"
fm_module "$PY" sglang; fm_transfer "$PY" "$TRANSFER_BACKEND" "$DEVICE"

SGLANG_DECODE_SWAP_P=0; SGLANG_PATHP_SCORE_RESIDENT=0; SGLANG_PATHP_INDEX_K_OFFLOAD=0; SGLANG_FLASHMEMORY_DUMP=0
SGLANG_OPT_USE_ONLINE_COMPRESS="$FM_ONLINE_COMPRESS"; SGLANG_DISAGGREGATION_WAITING_TIMEOUT=6000; SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1

CG=(--disable-overlap-schedule)   # DEVICE=cpu: P's overlap loop records a torch.cuda.Event for cached prefixes
[[ "$DEVICE" == cpu ]] || CG=(--cuda-graph-backend-decode disabled)   # (CUDA graphs: off in FM_DEV_ARGS on cpu)

fm_run SGLANG_DECODE_SWAP_P SGLANG_PATHP_SCORE_RESIDENT SGLANG_PATHP_INDEX_K_OFFLOAD SGLANG_FLASHMEMORY_DUMP \
  SGLANG_OPT_USE_ONLINE_COMPRESS SGLANG_DISAGGREGATION_WAITING_TIMEOUT SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN \
  "${FM_DEV_VARS[@]}" "${FM_BIND_VARS[@]}" -- \
  "$PY" -m sglang.launch_server --trust-remote-code --model-path "$MODEL" --tp-size "$TP" "${FM_DEV_ARGS[@]}" \
  "${CG[@]}" --disaggregation-mode prefill \
  --disaggregation-transfer-backend "$TRANSFER_BACKEND" --disaggregation-bootstrap-port "$BOOTSTRAP_PORT" \
  --swa-full-tokens-ratio "$SWA_RATIO" --max-running-requests "$MAX_RUN" --mem-fraction-static "$MEM_FRAC" \
  --context-length "$CTX_LEN" --skip-server-warmup --enable-metrics --host "$HOST" --port "$PORT"
