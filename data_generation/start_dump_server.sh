#!/usr/bin/env bash
# Native (non-PD) DeepSeek-V4 server for golden-label dumps: CUDA graph off, dump mode on, offload gates off.
# Requests opt in with custom_params {"flashmemory_dump": {"output_dir": "/abs/dir", ...}}.
# Knobs (env): MODEL TP PORT HOST CTX_LEN.  DRY_RUN=1 prints the environment and command instead of running.
set -euo pipefail
FM_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$FM_REPO/scripts/launch_common.sh"

MODEL="${MODEL:-path/to/ds_fp8}"; TP="${TP:-8}"; PORT="${PORT:-30000}"; HOST="${HOST:-0.0.0.0}"
CTX_LEN="${CTX_LEN:-1100000}"
fm_int TP "$TP" 1; fm_int PORT "$PORT" 1; fm_int CTX_LEN "$CTX_LEN" 1
PY="$(fm_python)"
fm_path "model path (MODEL)" "$MODEL"
fm_module "$PY" sglang; fm_module "$PY" flashmemory

SGLANG_FLASHMEMORY_DUMP=1; SGLANG_DECODE_SWAP_P=0; SGLANG_PATHP_SCORE_RESIDENT=0; SGLANG_PATHP_INDEX_K_OFFLOAD=0
SGLANG_PATHP_CUDAGRAPH=0; SGLANG_RETRIEVER_INLINE_CKPT=
no_proxy="localhost,127.0.0.1,0.0.0.0${no_proxy:+,$no_proxy}"

fm_run SGLANG_FLASHMEMORY_DUMP SGLANG_DECODE_SWAP_P SGLANG_PATHP_SCORE_RESIDENT SGLANG_PATHP_INDEX_K_OFFLOAD \
  SGLANG_PATHP_CUDAGRAPH SGLANG_RETRIEVER_INLINE_CKPT no_proxy -- \
  "$PY" -m sglang.launch_server --trust-remote-code --model-path "$MODEL" --tp-size "$TP" \
  --moe-runner-backend marlin --cuda-graph-backend-decode disabled --context-length "$CTX_LEN" \
  --host "$HOST" --port "$PORT"
