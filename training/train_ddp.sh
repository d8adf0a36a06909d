#!/usr/bin/env bash
# Usage: bash training/train_ddp.sh {single|ddp} [nproc] -- [extra flashmemory-train flags]
# single: one process; ddp: torchrun with nproc processes (gloo on CPU, NCCL on GPU).
# DATA_CONFIG (default training/configs/micro.json) and OUT (default checkpoints/ddp) may be set.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mode="${1:-single}"; shift || true
nproc="${1:-2}"; [[ "${1:-}" =~ ^[0-9]+$ ]] && shift || true
[[ "${1:-}" == "--" ]] && shift || true
data_config="${DATA_CONFIG:-$here/configs/micro.json}"
out="${OUT:-checkpoints/ddp}"
args=(--data-config "$data_config" --output-dir "$out" --epochs 5 --batch-size 8 --lr 1e-4 --wd 0.01
      --sample-interval 1 --label-interval 64 --max-pos 512 --neg-ratio 3 --weighted-loss
      --val-every-steps 1000 --patience-vals 3 "$@")
case "$mode" in
  single) exec python "$here/train.py" "${args[@]}" ;;
  ddp) exec torchrun --nproc_per_node "$nproc" --master_port "${MASTER_PORT:-29500}" "$here/train.py" "${args[@]}" ;;
  *) echo "usage: $0 {single|ddp} [nproc] -- [flags]" >&2; exit 2 ;;
esac
