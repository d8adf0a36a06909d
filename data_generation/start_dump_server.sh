#!/usr/bin/env bash
# Native (non-PD) DeepSeek-V4 server for golden-label dumps: CUDA graph off, dump mode on, offload gates off.
# Requests opt in with custom_params {"flashmemory_dump": {"output_dir": "/abs/dir", ...}}; the server writes only
# under DUMP_ROOT (required, absolute): a request whose output_dir lies outside it is refused (HTTP 400).
# Knobs (env): MODEL TP PORT HOST (default 127.0.0.1: this machine only; HOST=0.0.0.0 opens it to the network)
# CTX_LEN DUMP_ROOT DEVICE(cuda|cpu) PYTHON.  DRY_RUN=1 prints the environment and command instead of running.
# DEVICE=cpu: sglang on CPU with the tiny model (tp 1, 4K context), e.g. to try the dump pipeline end to end.
set -euo pipefail
FM_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$FM_REPO/scripts/launch_common.sh"

DEVICE="${DEVICE:-cuda}"; fm_device_setup "$DEVICE"
HOST="${HOST:-127.0.0.1}"; DUMP_ROOT="${DUMP_ROOT:-}"
if [[ "$DEVICE" == cpu ]]; then
  MODEL="${MODEL:-$FM_CPU_MODEL}"; TP="${TP:-1}"; CTX_LEN="${CTX_LEN:-4096}"
  EXTRA=(--max-running-requests "${MAX_RUN:-4}" --skip-server-warmup)
else
  MODEL="${MODEL:-path/to/ds_fp8}"; TP="${TP:-8}"; CTX_LEN="${CTX_LEN:-1100000}"
  EXTRA=(--cuda-graph-backend-decode disabled)   # DEVICE=cpu: in FM_DEV_ARGS
fi
PORT="${PORT:-30000}"
fm_int TP "$TP" 1; fm_int PORT "$PORT" 1; fm_int CTX_LEN "$CTX_LEN" 1
[[ -n "$DUMP_ROOT" ]] || fm_die "DUMP_ROOT is not set: give the absolute directory the server may write dumps under" \
  "(clients' --output-dir must lie inside it), e.g. DUMP_ROOT=/data/dumps"
[[ "$DUMP_ROOT" == /* ]] || fm_die "DUMP_ROOT=$DUMP_ROOT must be an absolute path"
[[ "/$DUMP_ROOT/" != *"/../"* ]] || fm_die "DUMP_ROOT=$DUMP_ROOT must not contain '..'"
fm_path "dump root (DUMP_ROOT)" "$DUMP_ROOT"
[[ "$HOST" == 127.0.0.1 || "$HOST" == localhost || "$HOST" == ::1 ]] || \
  fm_warn "HOST=$HOST: the dump server accepts requests from the network (any client may write under $DUMP_ROOT)"
fm_local_only "$HOST" "${EXTRA[@]}"
PY="$(fm_python)"
fm_path "model path (MODEL)" "$MODEL"
fm_module "$PY" sglang; fm_module "$PY" flashmemory

SGLANG_FLASHMEMORY_DUMP=1; SGLANG_FLASHMEMORY_DUMP_ROOT="$DUMP_ROOT"; SGLANG_DECODE_SWAP_P=0; SGLANG_PATHP_SCORE_RESIDENT=0; SGLANG_PATHP_INDEX_K_OFFLOAD=0
SGLANG_PATHP_CUDAGRAPH=0; SGLANG_RETRIEVER_INLINE_CKPT=
no_proxy="localhost,127.0.0.1,0.0.0.0${no_proxy:+,$no_proxy}"

fm_run SGLANG_FLASHMEMORY_DUMP SGLANG_FLASHMEMORY_DUMP_ROOT SGLANG_DECODE_SWAP_P SGLANG_PATHP_SCORE_RESIDENT \
  SGLANG_PATHP_INDEX_K_OFFLOAD SGLANG_PATHP_CUDAGRAPH SGLANG_RETRIEVER_INLINE_CKPT no_proxy "${FM_DEV_VARS[@]}" "${FM_BIND_VARS[@]}" -- \
  "$PY" -m sglang.launch_server --trust-remote-code --model-path "$MODEL" --tp-size "$TP" "${FM_DEV_ARGS[@]}" \
  "${EXTRA[@]}" --context-length "$CTX_LEN" --host "$HOST" --port "$PORT"
