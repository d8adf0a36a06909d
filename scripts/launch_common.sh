# Shared helpers for launch_*.sh and data_generation/start_dump_server.sh (sourced, not run).
# DRY_RUN=1: print the environment (every FlashMemory variable set, checked by the plugin's parser) and the exact
# command, check nothing that needs the model, run nothing.

fm_die() { echo "error: $*" >&2; exit 2; }
fm_warn() { echo "warning: $*" >&2; }

fm_int() {  # fm_int NAME VALUE [MIN]: decimal digits only, at most 9 (bash arithmetic wraps at 2^63 and reads
  # a leading 0 as octal, so the string is checked before any arithmetic and read in base 10)
  [[ "$2" =~ ^[0-9]+$ ]] || fm_die "$1=$2 is not a non-negative integer"
  [[ "$2" =~ ^0*[0-9]{1,9}$ ]] || fm_die "$1=$2 is too large (at most 9 digits; is it a typo?)"
  (( 10#$2 >= ${3:-0} )) || fm_die "$1=$2 must be >= ${3:-0}"
}

fm_float() {  # fm_float NAME VALUE: a number in (0, 1]
  [[ "$2" =~ ^(0?\.[0-9]+|1(\.0*)?|0*\.?[0-9]+e-?[0-9]+)$ ]] || fm_die "$1=$2 is not a number in (0, 1]"
  awk -v v="$2" 'BEGIN { exit !(v > 0 && v <= 1) }' || fm_die "$1=$2 must lie in (0, 1]"
}

fm_layers() {  # fm_layers NAME "10,12,20": c4-layer ids in [0, 21)
  [[ "$2" =~ ^[0-9]+(,[0-9]+)*$ ]] || fm_die "$1=$2: expected comma-separated c4 layer ids like 10,12,20"
  local id; IFS=',' read -ra _ids <<< "$2"
  for id in "${_ids[@]}"; do (( id < 21 )) || fm_die "$1=$2: layer $id outside [0, 21) (ids count c4 layers)"; done
}

fm_choice() {  # fm_choice NAME VALUE a b c
  local n="$1" v="$2"; shift 2
  local c; for c in "$@"; do [[ "$v" == "$c" ]] && return 0; done
  fm_die "$n=$v: expected one of: $*"
}

fm_path() {  # fm_path WHAT PATH: must exist unless DRY_RUN=1 (then a warning)
  [[ -e "$2" ]] && return 0
  if [[ "${DRY_RUN:-0}" == 1 ]]; then fm_warn "$1 $2 does not exist (DRY_RUN: not checked further)";
  else fm_die "$1 $2 does not exist"; fi
}

fm_python() {  # PYTHON (knob) wins, then the repo's .venv, then python3 on PATH
  if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; elif [[ -x "$FM_REPO/.venv/bin/python" ]]; then echo "$FM_REPO/.venv/bin/python";
  else echo python3; fi
}

fm_module() {  # fm_module PY MODULE [EXTRA]: the module must be installed unless DRY_RUN=1
  "$1" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$2') is None)" 2>/dev/null && return 0
  if [[ "${DRY_RUN:-0}" == 1 ]]; then fm_warn "python package $2 is not importable with $1";
  else fm_die "python package $2 is not importable with $1 (install it: pip install -e '.[${3:-serve}]')"; fi
}

fm_transfer() {  # fm_transfer PY BACKEND DEVICE: the PD transfer backend must really import (shared libraries too)
  local mod hint
  case "$2" in
    nixl) mod="nixl._api"; hint="pip install -e '.[serve-nixl]'";;
    mooncake|mooncake_tcp) mod="mooncake.engine"
      if [[ "$3" == cpu ]]; then hint="pip install -e '.[serve-mooncake-cpu]' and the OS package libibverbs1";
      else hint="pip install -e '.[serve-mooncake]'"; fi;;
    *) return 0;;
  esac
  local err
  err="$("$1" -c "import $mod" 2>&1)" && return 0
  err="$(printf '%s\n' "$err" | tail -n 1)"
  if [[ "${DRY_RUN:-0}" == 1 ]]; then fm_warn "TRANSFER_BACKEND=$2: python module $mod does not import with $1 ($err)";
  else fm_die "TRANSFER_BACKEND=$2 needs python module $mod, which does not import with $1 ($err); install it: $hint"; fi
}

# DEVICE=cpu runs sglang's own server on CPU through FlashMemory's CPU execution layer (flashmemory.sglang.cpu):
# a tiny model, for trying things out, development and CI. DEVICE=cuda (default) is the production path.
FM_CPU_LAYER_VAR=SGLANG_FLASHMEMORY_CPU
FM_CPU_MODEL="$FM_REPO/checkpoints/tiny-dsv4-sglang"   # MODEL's default with DEVICE=cpu (built on first use by `make serve`)
fm_device_setup() {  # fm_device_setup DEVICE: sets FM_DEV_VARS (names to export) and FM_DEV_ARGS (sglang flags)
  fm_choice DEVICE "$1" cuda cpu
  FM_DEV_VARS=(); FM_DEV_ARGS=()
  # upstream runs the online compressor (JIT CUDA planner with pinned buffers); the CPU layer covers the default one
  FM_ONLINE_COMPRESS=1
  if [[ "$1" == cuda ]]; then FM_DEV_ARGS=(--base-gpu-id 0 --moe-runner-backend marlin); return 0; fi
  FM_ONLINE_COMPRESS=0
  printf -v "$FM_CPU_LAYER_VAR" 1
  # sglang's own switches for the CPU path (each avoids a CUDA/JIT kernel; see flashmemory/sglang/cpu)
  SGLANG_USE_CPU_ENGINE=1; TRITON_INTERPRET=1; SGLANG_OPT_FLASHMLA_SPARSE_PREFILL=0
  SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1; SGLANG_DSA_FUSE_TOPK=false; SGLANG_OPT_USE_TILELANG_MHC_PRE=0
  SGLANG_OPT_USE_TILELANG_MHC_POST=0; SGLANG_OPT_FUSE_MHC_POST_PRE=0; SGLANG_OPT_DEEPGEMM_HC_PRENORM=0
  SGLANG_OPT_USE_FUSED_HASH_TOPK=0; SGLANG_OPT_FP8_WO_A_GEMM=0; SGLANG_DSV41_FUSED_WO_A=0
  SGLANG_OPT_DSV4_NONPAGED_INDEXER=0; SGLANG_OPT_USE_JIT_INDEXER_METADATA=0; SGLANG_CUDA_COREDUMP_BEFORE_CRASH=0
  # /health answers from state instead of queueing a 1-token generation behind minutes-long CPU forwards
  SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0
  # D polls P's bootstrap /health every 5 s (3-s timeout) and drops P after 2 misses, failing every request in
  # flight ("Lost connection with prefill instance"); a CPU P busy with a 1024-token prefill chunk on a shared
  # 2-core box missed it for over 10 s (three ~2K-token chats, the demo's stage 7): allow 60 misses, 5 minutes
  SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE="${SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE:-60}"
  FM_DEV_VARS=(SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE "$FM_CPU_LAYER_VAR" SGLANG_USE_CPU_ENGINE TRITON_INTERPRET SGLANG_OPT_FLASHMLA_SPARSE_PREFILL
    SGLANG_FP8_PAGED_MQA_LOGITS_TORCH SGLANG_DSA_FUSE_TOPK SGLANG_OPT_USE_TILELANG_MHC_PRE
    SGLANG_OPT_USE_TILELANG_MHC_POST SGLANG_OPT_FUSE_MHC_POST_PRE SGLANG_OPT_DEEPGEMM_HC_PRENORM
    SGLANG_OPT_USE_FUSED_HASH_TOPK SGLANG_OPT_FP8_WO_A_GEMM SGLANG_DSV41_FUSED_WO_A SGLANG_OPT_DSV4_NONPAGED_INDEXER
    SGLANG_OPT_USE_JIT_INDEXER_METADATA SGLANG_CUDA_COREDUMP_BEFORE_CRASH)
  # a fixed small pool (else sized from host RAM: 13 GB, 42 s), small chunks, torch top-k, no CUDA graphs;
  # --sleep-on-idle: an idle scheduler otherwise polls its sockets at ~35% of a core (P and D both idle most of
  # the time on CPU), which halves a 2-core box
  FM_DEV_ARGS=(--device cpu --max-total-tokens "${MAX_TOTAL_TOKENS:-16384}" --chunked-prefill-size 1024
    --max-prefill-tokens 2048 --dsa-topk-backend torch --cuda-graph-backend-decode disabled --sleep-on-idle)
}

fm_is_loopback() {  # fm_is_loopback HOST: localhost, 127.0.0.0/8, or the IPv6 loopback in any spelling (::1,
  # 0:0:0:0:0:0:0:1, 0::0001, [::1]); the twin of is_loopback_host in flashmemory/serve/procs.py
  local h="${1,,}" c
  [[ "$h" == \[*\] ]] && h="${h:1:${#h}-2}"
  if [[ "$h" =~ ^127\.(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})$ ]]; then
    for c in "${BASH_REMATCH[@]:1}"; do (( 10#$c <= 255 )) || return 1; done; return 0
  fi
  [[ "$h" == localhost ]] && return 0
  [[ "$h" =~ ^(0{1,4}:|:)+0{0,3}1$ && "$h" != *:::* && "${h/::/}" != *::* ]] || return 1  # zero groups, then 1
  c="${h//[^:]/}"  # 7 colons (8 groups), or fewer with one "::" standing for at least one zero group
  if [[ "$h" == *::* ]]; then (( ${#c} <= 7 )) || [[ "$h" == ::* && ${#c} == 8 ]]; else (( ${#c} == 7 )); fi
}

fm_local_only() {  # fm_local_only HOST [SGLANG_ARGS...]: sets FM_BIND_VARS (names to export)
  # With a loopback HOST (the default) every listener of the server stays on this machine, not only its HTTP port:
  # sglang's KV-transfer sockets (NIXL/Mooncake bootstrap, bound on SGLANG_HOST_IP), gloo and NCCL (their socket
  # interface), Mooncake's TCP transport (MC_TCP_BIND_ADDRESS), NIXL's UCX network devices (UCX_NET_DEVICES: its
  # TCP transport listens on each; lo leaves RDMA NICs out, not cuda_ipc/shm), and the torch.distributed
  # rendezvous: torch's TCPStore listens on every interface whatever address it is given, so a file store replaces
  # it (one node; a fresh path, created by torch). With TRANSFER_BACKEND=mooncake* the loopback-bind shim is
  # preloaded too (fm_loopback_shim). A value the user set wins; another HOST or --dist-init-addr keeps stock
  # sglang's listeners.
  FM_BIND_VARS=()
  fm_is_loopback "$1" || return 0
  local a; for a in "${@:2}"; do [[ "$a" != --dist-init-addr* ]] || return 0; done
  SGLANG_HOST_IP="${SGLANG_HOST_IP:-127.0.0.1}"; GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"
  NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"; MC_TCP_BIND_ADDRESS="${MC_TCP_BIND_ADDRESS:-127.0.0.1}"
  UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
  local store="file://${TMPDIR:-/tmp}/flashmemory-dist-$$-$RANDOM$RANDOM"
  SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE="${SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE:-$store}"
  FM_BIND_VARS=(SGLANG_HOST_IP GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME MC_TCP_BIND_ADDRESS UCX_NET_DEVICES
    SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE)
  case "${TRANSFER_BACKEND:-}" in mooncake*) fm_loopback_shim;; esac
}

fm_loopback_shim() {  # put flashmemory/serve/loopback_bind.c (built once, cached) first in LD_PRELOAD
  # Mooncake's transfer engine binds its RPC/handshake port on 0.0.0.0 and its TCP data port on :: whatever it is
  # told; the shim turns those binds into 127.0.0.1 and ::ffff:127.0.0.1 (::1 on an IPv6-only socket) and leaves
  # every other bind alone. Without a C compiler: one warning saying what stays open and how to firewall it.
  local shim had="${LD_PRELOAD:-}"
  if shim="$(PYTHONPATH="$FM_REPO${PYTHONPATH:+:$PYTHONPATH}" "$(fm_python)" -m flashmemory.serve.loopback)"; then
    case " ${had//:/ } " in *" $shim "*) ;; *) LD_PRELOAD="$shim${had:+ $had}";; esac
    FM_BIND_VARS+=(LD_PRELOAD)
  else
    fm_warn "${shim:-the loopback-bind shim (flashmemory.serve.loopback) failed}"
  fi
}

fm_word() {  # fm_word VALUE: VALUE as the plugin compares it (flashmemory/env.py: lower case, surrounding spaces dropped)
  local v="${1,,}"
  v="${v#"${v%%[![:space:]]*}"}"; printf '%s' "${v%"${v##*[![:space:]]}"}"
}

fm_on() {  # fm_on VALUE: true when the plugin reads VALUE as on (1, true, yes, on; any case, surrounding spaces
  # ignored); anything else is off here, and a value that is neither on nor off is refused by fm_env_check
  case "$(fm_word "$1")" in 1|true|yes|on) return 0;; *) return 1;; esac
}

fm_flag() {  # fm_flag NAME...: each knob a boolean spelled as the plugin reads one (on: 1, true, yes, on; off: 0,
  # false, no, off), set to 1 or 0 for the script's own tests; anything else is an error naming it
  local n
  for n in "$@"; do
    case "$(fm_word "${!n}")" in
      1|true|yes|on) printf -v "$n" 1;;
      0|false|no|off) printf -v "$n" 0;;
      *) fm_die "$n=${!n}: expected 0/1 (or true/false, yes/no, on/off)";;
    esac
  done
}

fm_env_check() {  # fm_env_check NAME...: every FlashMemory variable of the environment, read by the plugin's own
  # parser (python -m flashmemory.env_check: one line per bad variable, exit 2); DRY_RUN=1 also prints each one
  # set and not among the NAMEs (which fm_run prints itself), the disk-tier and prefetch ones included
  local args=() rc=0
  [[ "${DRY_RUN:-0}" != 1 ]] || args=(--print "$@")
  PYTHONPATH="$FM_REPO${PYTHONPATH:+:$PYTHONPATH}" "$(fm_python)" -m flashmemory.env_check "${args[@]}" || rc=$?
  (( rc != 2 )) || exit 2
  (( rc == 0 )) || fm_warn "FlashMemory variables not checked: python -m flashmemory.env_check exited with $rc"
}

fm_run() {  # fm_run VAR... -- CMD...: export the named variables, then run (or print) the command
  local names=()
  while [[ "$1" != "--" ]]; do names+=("$1"); shift; done; shift
  local n
  for n in "${names[@]}"; do export "$n"; done
  local server=0; [[ " $* " != *" sglang.launch_server "* ]] || server=1   # the plugin reads its variables there
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    for n in "${names[@]}"; do printf 'ENV %s=%q\n' "$n" "${!n}"; done
    (( server == 0 )) || fm_env_check "${names[@]}"
    printf 'CMD'; printf ' %q' "$@"; printf '\n'
    exit 0
  fi
  (( server == 0 )) || fm_env_check
  exec "$@"
}
