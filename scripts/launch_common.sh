# Shared helpers for launch_*.sh and data_generation/start_dump_server.sh (sourced, not run).
# DRY_RUN=1: print the environment and the exact command, check nothing that needs the model, run nothing.

fm_die() { echo "error: $*" >&2; exit 2; }
fm_warn() { echo "warning: $*" >&2; }

fm_int() {  # fm_int NAME VALUE [MIN]
  [[ "$2" =~ ^[0-9]+$ ]] || fm_die "$1=$2 is not a non-negative integer"
  (( $2 >= ${3:-0} )) || fm_die "$1=$2 must be >= ${3:-0}"
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

fm_python() { if [[ -x "$FM_REPO/.venv/bin/python" ]]; then echo "$FM_REPO/.venv/bin/python"; else echo python3; fi; }

fm_module() {  # fm_module PY MODULE: the module must import unless DRY_RUN=1
  "$1" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$2') is None)" 2>/dev/null && return 0
  if [[ "${DRY_RUN:-0}" == 1 ]]; then fm_warn "python package $2 is not importable with $1";
  else fm_die "python package $2 is not importable with $1 (install it: pip install -e '.[serve]')"; fi
}

fm_run() {  # fm_run VAR... -- CMD...: export the named variables, then run (or print) the command
  local names=()
  while [[ "$1" != "--" ]]; do names+=("$1"); shift; done; shift
  local n
  for n in "${names[@]}"; do export "$n"; done
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    for n in "${names[@]}"; do printf 'ENV %s=%q\n' "$n" "${!n}"; done
    printf 'CMD'; printf ' %q' "$@"; printf '\n'
    exit 0
  fi
  exec "$@"
}
