#!/usr/bin/env bash
# D server of the PD pair, FlashMemory gates on. Start order: D, then P (launch_prefill.sh), then the router.
# Knobs (env): MODEL TP CTX_LEN TGT_CONC TGT_CTX KMAX HOST PORT TRANSFER_BACKEND(nixl|mooncake|mooncake_tcp)
#   BOOTSTRAP_PORT MAX_RUN CKPT LAYERS THRESH INTERVAL LAST_KEEP SCORE_RESIDENT INDEX_K_OFFLOAD CUDA_GRAPH
#   C4_SHRINK (1: c4 KV lands in the host mirror, the device c4 pool becomes the reserve; needs nixl)
#   CREDIT_C4 (0; 1: sglang sizes its token pool without the c4 KV bytes, --mem-fraction-static lowered by the reserve)
#   SWA_RATIO (auto | sglang | a ratio) MEM_FRAC GPU_MIB: the pool settings, see "Pools" below
#   FLASHMEMORY (1; 0: stock sglang decode, every FlashMemory gate off, for A/B runs)
#   DEVICE (cuda; cpu: sglang on CPU with the tiny model, tp 1, 4K context, 4 requests, no CUDA graph) PYTHON
# Arguments after the script's name go to sglang unchanged, after its own (e.g. HiSparse's --enable-hisparse ...).
# DRY_RUN=1 prints the environment and the command instead of running them.
set -euo pipefail
FM_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$FM_REPO/scripts/launch_common.sh"

DEVICE="${DEVICE:-cuda}"; fm_device_setup "$DEVICE"
if [[ "$DEVICE" == cpu ]]; then   # the tiny model: 2 c4 layers, 4K context; no retriever unless CKPT is given
  MODEL="${MODEL:-$FM_CPU_MODEL}"; TP="${TP:-1}"; CTX_LEN="${CTX_LEN:-4096}"; TGT_CONC="${TGT_CONC:-4}"
  TGT_CTX="${TGT_CTX:-4096}"; MAX_RUN="${MAX_RUN:-4}"; CKPT="${CKPT-}"; LAYERS="${LAYERS:-0,1}"
  LAST_KEEP="${LAST_KEEP:-256}"; CUDA_GRAPH="${CUDA_GRAPH:-0}"; KMAX="${KMAX:-16}"   # 16 pages: a whole 4K history
else
  MODEL="${MODEL:-/dockerdata/models/ds_fp8}"; TP="${TP:-8}"; CTX_LEN="${CTX_LEN:-1100000}"; TGT_CONC="${TGT_CONC:-60}"
  TGT_CTX="${TGT_CTX:-524288}"; MAX_RUN="${MAX_RUN:-128}"
  CKPT="${CKPT-$FM_REPO/checkpoints/top3_R930_joint.pt}"; LAYERS="${LAYERS:-10,12,20}"; LAST_KEEP="${LAST_KEEP:-2048}"
  CUDA_GRAPH="${CUDA_GRAPH:-1}"
fi
HOST="${HOST:-127.0.0.1}"   # this machine only; HOST=<this node's address> (or 0.0.0.0) opens it to the network
KMAX="${KMAX:-96}"; PORT="${PORT:-31200}"; TRANSFER_BACKEND="${TRANSFER_BACKEND:-nixl}"; BOOTSTRAP_PORT="${BOOTSTRAP_PORT:-8998}"
THRESH="${THRESH:-0.5}"; INTERVAL="${INTERVAL:-64}"; SCORE_RESIDENT="${SCORE_RESIDENT:-1}"
INDEX_K_OFFLOAD="${INDEX_K_OFFLOAD:-0}"; C4_SHRINK="${C4_SHRINK:-1}"; CREDIT_C4="${CREDIT_C4:-0}"
FLASHMEMORY="${FLASHMEMORY:-1}"

fm_int TP "$TP" 1; fm_int CTX_LEN "$CTX_LEN" 1; fm_int TGT_CONC "$TGT_CONC" 1; fm_int TGT_CTX "$TGT_CTX" 1
fm_int KMAX "$KMAX" 1; fm_int PORT "$PORT" 1; fm_int MAX_RUN "$MAX_RUN" 1; fm_int BOOTSTRAP_PORT "$BOOTSTRAP_PORT" 1
fm_int INTERVAL "$INTERVAL" 1; fm_int LAST_KEEP "$LAST_KEEP"; fm_float THRESH "$THRESH"; fm_layers LAYERS "$LAYERS"
fm_choice TRANSFER_BACKEND "$TRANSFER_BACKEND" nixl mooncake mooncake_tcp
fm_flag SCORE_RESIDENT INDEX_K_OFFLOAD CUDA_GRAPH C4_SHRINK CREDIT_C4 FLASHMEMORY   # 1/0, spelled as the plugin reads
fm_local_only "$HOST" "$@"
if [[ "$C4_SHRINK" == 1 && "$TRANSFER_BACKEND" != nixl ]]; then
  echo "note: C4_SHRINK=1 needs TRANSFER_BACKEND=nixl (PD into host DRAM); Path-P will run in copy mode" >&2
fi
PY="$(fm_python)"
fm_path "model path (MODEL)" "$MODEL"
[[ -z "$CKPT" ]] || fm_path "retriever checkpoint (CKPT; CKPT= runs without Level 1)" "$CKPT"
fm_module "$PY" sglang; fm_module "$PY" flashmemory
fm_transfer "$PY" "$TRANSFER_BACKEND" "$DEVICE"

SGLANG_DECODE_SWAP_P=1; SGLANG_PATHP_CUDAGRAPH="$CUDA_GRAPH"; SGLANG_PATHP_SCORE_RESIDENT="$SCORE_RESIDENT"
SGLANG_PATHP_PAGE_RECALL=1; SGLANG_PATHP_PAGE_KMAX="$KMAX"; SGLANG_PATHP_ASYNC_RECALL=1
SGLANG_PATHP_INDEX_K_OFFLOAD="$INDEX_K_OFFLOAD"; SGLANG_PATHP_DECODE_RESIDENT_CHUNKS=512; SGLANG_PATHP_DECODE_MAX_CONC="$MAX_RUN"
SGLANG_DSV4_TARGET_CONCURRENCY="$TGT_CONC"; SGLANG_DSV4_TARGET_CONTEXT="$TGT_CTX"
SGLANG_RETRIEVER_INLINE_CKPT="$CKPT"; SGLANG_RETRIEVER_INLINE_LAYERS="$LAYERS"; SGLANG_RETRIEVER_SIGMOID_THRESH="$THRESH"
SGLANG_RETRIEVER_INTERVAL="$INTERVAL"; SGLANG_RETRIEVER_LAST_KEEP="$LAST_KEEP"; SGLANG_RETRIEVER_FIRST_KEEP=0
SGLANG_RETRIEVER_ENSEMBLE_MODE=or; SGLANG_OPT_USE_ONLINE_COMPRESS="$FM_ONLINE_COMPRESS"
SGLANG_PD_B_C4_SHRINK="$C4_SHRINK"; SGLANG_PD_CREDIT_OFFLOADED_C4="$CREDIT_C4"
SGLANG_DISAGGREGATION_WAITING_TIMEOUT=6000; SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1
if [[ "$FLASHMEMORY" == 0 ]]; then   # stock decode: the plugin registers nothing
  SGLANG_DECODE_SWAP_P=0; SGLANG_PATHP_SCORE_RESIDENT=0; SGLANG_PATHP_INDEX_K_OFFLOAD=0; SGLANG_PD_B_C4_SHRINK=0
  SGLANG_PD_CREDIT_OFFLOADED_C4=0
  # HiSparse with FlashMemory's prefetch (SGLANG_FLASHMEMORY_HISPARSE_PREFETCH=1): Level 1 keeps CKPT as its hint source
  fm_on "${SGLANG_FLASHMEMORY_HISPARSE_PREFETCH:-}" || SGLANG_RETRIEVER_INLINE_CKPT=   # on as the plugin reads it
fi
CG=(); [[ "$CUDA_GRAPH" == 1 || "$DEVICE" == cpu ]] || CG=(--cuda-graph-backend-decode disabled)
[[ "$CUDA_GRAPH" == 0 || "$DEVICE" != cpu ]] || fm_die "CUDA_GRAPH=1 with DEVICE=cpu: CPU has no CUDA graphs"
# Pools (flashmemory/costmodel/launch_settings.py), stock and FlashMemory alike: SWA_RATIO auto = the smallest
# --swa-full-tokens-ratio whose SWA pool holds TGT_CONC requests of TGT_CTX (sglang's DeepSeek-V4 default 0.1 with
# SWA_RATIO=sglang, or a given ratio); CREDIT_C4=1 (cuda): --mem-fraction-static (MEM_FRAC, else sglang's default
# for GPU_MIB, from nvidia-smi when unset) lowered by FlashMemory's reserve, so the reserve is not taken from headroom.
SWA_RATIO="${SWA_RATIO:-auto}"; MEM_FRAC="${MEM_FRAC:-}"; GPU_MIB="${GPU_MIB:-}"
[[ "$SWA_RATIO" == auto || "$SWA_RATIO" == sglang ]] || fm_float SWA_RATIO "$SWA_RATIO"
[[ -z "$MEM_FRAC" ]] || fm_float MEM_FRAC "$MEM_FRAC"; [[ -z "$GPU_MIB" ]] || fm_int GPU_MIB "$GPU_MIB" 1
FM_CREDIT=0; [[ "$SGLANG_PD_CREDIT_OFFLOADED_C4" == 1 && "$DEVICE" == cuda ]] && FM_CREDIT=1
if [[ "$FM_CREDIT" == 1 && -z "$GPU_MIB" ]] && command -v nvidia-smi >/dev/null 2>&1; then
  GPU_MIB="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2>/dev/null | tr -dc 0-9 || true)"
fi
FM_POOL="$("$PY" -m flashmemory.costmodel.launch_settings --context "$TGT_CTX" --concurrency "$TGT_CONC" \
  --max-running "$MAX_RUN" --reserved 1024 --model "$MODEL" --credit-c4 "$FM_CREDIT" --kmax "$KMAX" \
  --decode-max-conc "$MAX_RUN" --path-i "$SGLANG_PATHP_INDEX_K_OFFLOAD" --tp "$TP" ${GPU_MIB:+--gpu-mib "$GPU_MIB"} \
  ${MEM_FRAC:+--mem-fraction "$MEM_FRAC"})" || exit 2
read -r FM_SWA_RATIO FM_MEM_FRAC FM_RESERVE_GIB <<< "$FM_POOL"
[[ "$SWA_RATIO" == auto ]] || FM_SWA_RATIO="$SWA_RATIO"
POOL_ARGS=(); [[ "$FM_SWA_RATIO" == sglang ]] || POOL_ARGS=(--swa-full-tokens-ratio "$FM_SWA_RATIO")
[[ "$FM_MEM_FRAC" == - ]] || POOL_ARGS+=(--mem-fraction-static "$FM_MEM_FRAC")
echo "pools: --swa-full-tokens-ratio $FM_SWA_RATIO (SWA_RATIO=$SWA_RATIO, TGT_CONC=$TGT_CONC x TGT_CTX=$TGT_CTX)" \
  "--mem-fraction-static ${FM_MEM_FRAC/-/sglang\'s default}$([[ "$FM_CREDIT" == 0 ]] || echo " (lowered by the ${FM_RESERVE_GIB} GiB reserve)")" >&2

fm_run SGLANG_DECODE_SWAP_P SGLANG_PATHP_CUDAGRAPH SGLANG_PATHP_SCORE_RESIDENT SGLANG_PATHP_PAGE_RECALL \
  SGLANG_PATHP_PAGE_KMAX SGLANG_PATHP_ASYNC_RECALL SGLANG_PATHP_INDEX_K_OFFLOAD SGLANG_PATHP_DECODE_RESIDENT_CHUNKS \
  SGLANG_PATHP_DECODE_MAX_CONC SGLANG_DSV4_TARGET_CONCURRENCY SGLANG_DSV4_TARGET_CONTEXT SGLANG_RETRIEVER_INLINE_CKPT \
  SGLANG_RETRIEVER_INLINE_LAYERS SGLANG_RETRIEVER_SIGMOID_THRESH SGLANG_RETRIEVER_INTERVAL SGLANG_RETRIEVER_LAST_KEEP \
  SGLANG_RETRIEVER_FIRST_KEEP SGLANG_RETRIEVER_ENSEMBLE_MODE SGLANG_OPT_USE_ONLINE_COMPRESS \
  SGLANG_PD_B_C4_SHRINK SGLANG_PD_CREDIT_OFFLOADED_C4 \
  SGLANG_DISAGGREGATION_WAITING_TIMEOUT SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN "${FM_DEV_VARS[@]}" "${FM_BIND_VARS[@]}" \
  -- \
  "$PY" -m sglang.launch_server --trust-remote-code --model-path "$MODEL" --tp-size "$TP" "${FM_DEV_ARGS[@]}" \
  --disaggregation-mode decode --disaggregation-transfer-backend "$TRANSFER_BACKEND" \
  --disaggregation-bootstrap-port "$BOOTSTRAP_PORT" --num-reserved-decode-tokens 1024 --decode-log-interval 40 \
  --max-running-requests "$MAX_RUN" --context-length "$CTX_LEN" --skip-server-warmup --enable-metrics "${CG[@]}" \
  "${POOL_ARGS[@]}" --host "$HOST" --port "$PORT" "$@"
