#!/usr/bin/env bash
# Start (or stop) the strong + weak vLLM servers the live backend talks to (spec/live.md "Serving").
#
#   serving/vllm_pair.sh [start] [options]     start both servers, strong first; Ctrl-C stops both
#   serving/vllm_pair.sh stop [--run-dir DIR]  stop the servers started from this run dir
#   serving/vllm_pair.sh status [--run-dir DIR]
#   serving/vllm_pair.sh --help
#
# Every option also reads an environment variable (in brackets); flags win over the environment.
#   --layout one-gpu|node8|multi-node   [MESHHEAL_LAYOUT]       default one-gpu
#       one-gpu    both models on GPU 0 (141 GB class GPU): strong at 0.77, weak at 0.15 of memory
#       node8      strong on GPUs 0-6, weak on GPU 7 (0.90 each)
#       multi-node prints per-node commands and the client's URL lists (starts nothing)
#   --pair default|A|B                  [MESHHEAL_PAIR]         model pair (protocol.md §1)
#       default: openai/gpt-oss-120b / meta-llama/Llama-3.2-1B-Instruct
#       A:       openai/gpt-oss-120b / google/gemma-3-4b-it
#       B:       meta-llama/Llama-3.3-70B-Instruct / meta-llama/Llama-3.2-1B-Instruct
#   --strong-model ID, --weak-model ID  [MESHHEAL_STRONG_MODEL, MESHHEAL_WEAK_MODEL] override the pair
#   --host ADDR                         [MESHHEAL_HOST]         default 127.0.0.1 (0.0.0.0 exposes them)
#   --strong-port N, --weak-port N      [MESHHEAL_STRONG_PORT, MESHHEAL_WEAK_PORT]  8000 / 8001
#   --strong-gpus LIST, --weak-gpus LIST [MESHHEAL_STRONG_GPUS, MESHHEAL_WEAK_GPUS] e.g. 0,1,2
#   --strong-mem F, --weak-mem F        [MESHHEAL_STRONG_MEM, MESHHEAL_WEAK_MEM] --gpu-memory-utilization
#   --strong-tp N                       [MESHHEAL_STRONG_TP]    tensor parallel size per replica (1)
#   --strong-dp replicas|vllm           [MESHHEAL_STRONG_DP]    several strong replicas (node8) as
#       replicas   one independent server per replica, ports --strong-port + 0, 1, ...; the weak
#                  port moves past them unless given (default; the client round-robins the URLs)
#       vllm       one server with vLLM's --data-parallel-size (spec/live.md's layout): gpt-oss
#                  needs data x tensor parallel ranks to divide its MoE width 2880 (7 does not)
#   --max-model-len N                   [MESHHEAL_MAX_MODEL_LEN]  both servers (32768)
#   --strong-max-model-len N, --weak-max-model-len N
#   --max-num-seqs N                    [MESHHEAL_MAX_NUM_SEQS]   both servers (256)
#   --strong-max-num-seqs N, --weak-max-num-seqs N
#   --wait-timeout S                    [MESHHEAL_WAIT_TIMEOUT]   per server readiness wait (1800)
#                                       [MESHHEAL_WAIT_INTERVAL]  seconds between probes (5)
#   --run-dir DIR                       [MESHHEAL_SERVING_DIR]    logs and PIDs (runs/serving)
#   --nodes N, --node-hosts H1,H2,..., --head-address ADDR   multi-node hints
#   --detach                            return once both servers are ready (stop them with `stop`)
#   --dry-run                           print the commands only; start nothing
#
# Secrets: HF_TOKEN (gated models: meta-llama/*, google/gemma-*) and VLLM_API_KEY are read from the
# environment by vLLM itself; this script never prints or logs their values.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(dirname "$SCRIPT_DIR")"

die() { printf 'vllm_pair.sh: error: %s\n' "$*" >&2; exit 2; }
note() { printf 'vllm_pair.sh: %s\n' "$*" >&2; }

usage() { sed -n '2,41p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

# ---------------------------------------------------------------------------------------------
# Settings: flags > environment > layout defaults

ACTION=start
LAYOUT="${MESHHEAL_LAYOUT:-one-gpu}"
PAIR="${MESHHEAL_PAIR:-default}"
STRONG_MODEL="${MESHHEAL_STRONG_MODEL:-}"
WEAK_MODEL="${MESHHEAL_WEAK_MODEL:-}"
HOST="${MESHHEAL_HOST:-127.0.0.1}"
STRONG_PORT="${MESHHEAL_STRONG_PORT:-8000}"
WEAK_PORT="${MESHHEAL_WEAK_PORT:-8001}"
WEAK_PORT_GIVEN="${MESHHEAL_WEAK_PORT:+1}"
STRONG_GPUS="${MESHHEAL_STRONG_GPUS:-}"
WEAK_GPUS="${MESHHEAL_WEAK_GPUS:-}"
STRONG_MEM="${MESHHEAL_STRONG_MEM:-}"
WEAK_MEM="${MESHHEAL_WEAK_MEM:-}"
STRONG_TP="${MESHHEAL_STRONG_TP:-1}"
STRONG_DP_MODE="${MESHHEAL_STRONG_DP:-replicas}"
MAX_MODEL_LEN="${MESHHEAL_MAX_MODEL_LEN:-32768}"
STRONG_MAX_MODEL_LEN=""
WEAK_MAX_MODEL_LEN=""
MAX_NUM_SEQS="${MESHHEAL_MAX_NUM_SEQS:-256}"
STRONG_MAX_NUM_SEQS=""
WEAK_MAX_NUM_SEQS=""
WAIT_TIMEOUT="${MESHHEAL_WAIT_TIMEOUT:-1800}"
WAIT_INTERVAL="${MESHHEAL_WAIT_INTERVAL:-5}"  # seconds between readiness probes
RUN_DIR="${MESHHEAL_SERVING_DIR:-$REPO_DIR/runs/serving}"
NODES="${MESHHEAL_NODES:-2}"
NODE_HOSTS="${MESHHEAL_NODE_HOSTS:-}"
HEAD_ADDRESS="${MESHHEAL_HEAD_ADDRESS:-}"
DETACH=0
DRY_RUN=0
FORWARD=()  # the flags given that apply on every node (multi-node, option 1, passes them on)

if [[ $# -gt 0 && "$1" != -* ]]; then
  ACTION="$1"
  shift
fi
case "$ACTION" in
  start|stop|status) ;;
  help) usage; exit 0 ;;
  *) die "unknown command '$ACTION' (start, stop, status)" ;;
esac

while [[ $# -gt 0 ]]; do
  arg="$1"
  shift
  value=""
  if [[ "$arg" == --*=* ]]; then
    value="${arg#*=}"
    arg="${arg%%=*}"
    set -- "$value" "$@"
  fi
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    --dry-run) DRY_RUN=1; continue ;;
    --detach) DETACH=1; continue ;;
  esac
  [[ $# -gt 0 && "$1" != --* ]] || die "option $arg needs a value"
  value="$1"
  shift
  case "$arg" in
    --layout|--host|--run-dir|--nodes|--node-hosts|--head-address) ;;
    *) FORWARD+=("$arg" "$value") ;;
  esac
  case "$arg" in
    --layout) LAYOUT="$value" ;;
    --pair) PAIR="$value" ;;
    --strong-model) STRONG_MODEL="$value" ;;
    --weak-model) WEAK_MODEL="$value" ;;
    --host) HOST="$value" ;;
    --strong-port) STRONG_PORT="$value" ;;
    --weak-port) WEAK_PORT="$value"; WEAK_PORT_GIVEN=1 ;;
    --strong-gpus) STRONG_GPUS="$value" ;;
    --weak-gpus) WEAK_GPUS="$value" ;;
    --strong-mem) STRONG_MEM="$value" ;;
    --weak-mem) WEAK_MEM="$value" ;;
    --strong-tp) STRONG_TP="$value" ;;
    --strong-dp) STRONG_DP_MODE="$value" ;;
    --max-model-len) MAX_MODEL_LEN="$value" ;;
    --strong-max-model-len) STRONG_MAX_MODEL_LEN="$value" ;;
    --weak-max-model-len) WEAK_MAX_MODEL_LEN="$value" ;;
    --max-num-seqs) MAX_NUM_SEQS="$value" ;;
    --strong-max-num-seqs) STRONG_MAX_NUM_SEQS="$value" ;;
    --weak-max-num-seqs) WEAK_MAX_NUM_SEQS="$value" ;;
    --wait-timeout) WAIT_TIMEOUT="$value" ;;
    --run-dir) RUN_DIR="$value" ;;
    --nodes) NODES="$value" ;;
    --node-hosts) NODE_HOSTS="$value" ;;
    --head-address) HEAD_ADDRESS="$value" ;;
    *) die "unknown option '$arg' (see --help)" ;;
  esac
done

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }
is_fraction() { [[ "$1" =~ ^0?\.[0-9]+$ ]]; }
is_gpu_list() { [[ "$1" =~ ^[0-9]+(,[0-9]+)*$ ]]; }

# ---------------------------------------------------------------------------------------------
# stop / status: only the processes whose PIDs this script wrote, and only if they are vLLM

pid_file() { printf '%s/%s.pid' "$RUN_DIR" "$1"; }

running_pid() {  # prints the recorded PID of role $1 if that process is alive and is vllm
  local file pid
  file="$(pid_file "$1")"
  [[ -f "$file" ]] || return 1
  pid="$(<"$file")"
  is_uint "$pid" || return 1
  kill -0 "$pid" 2>/dev/null || return 1
  if [[ -r "/proc/$pid/cmdline" ]] && ! tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q vllm; then
    return 1
  fi
  printf '%s' "$pid"
}

stop_role() {
  local role="$1" pid waited=0
  if ! pid="$(running_pid "$role")"; then
    rm -f "$(pid_file "$role")"
    note "$role server: not running"
    return 0
  fi
  note "stopping the $role server (pid $pid)"
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null && (( waited < 60 )); do
    sleep 1
    waited=$((waited + 1))
  done
  if kill -0 "$pid" 2>/dev/null; then
    note "$role server did not stop in 60 s: killing it"
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$(pid_file "$role")"
}

recorded_roles() {  # the roles with a PID file in RUN_DIR (strong, or strong-1..N; weak); both by default
  local f found=()
  for f in "$RUN_DIR"/strong*.pid "$RUN_DIR"/weak.pid; do
    [[ -e "$f" ]] && found+=("$(basename "$f" .pid)")
  done
  (( ${#found[@]} )) || found=(strong weak)
  printf '%s\n' "${found[@]}"
}

if [[ "$ACTION" == stop ]]; then
  mapfile -t roles < <(recorded_roles)
  for ((k = ${#roles[@]} - 1; k >= 0; k--)); do stop_role "${roles[k]}"; done  # weak first
  exit 0
fi
if [[ "$ACTION" == status ]]; then
  mapfile -t roles < <(recorded_roles)
  for role in "${roles[@]}"; do
    if pid="$(running_pid "$role")"; then
      printf '%s: running (pid %s, log %s/%s.log)\n' "$role" "$pid" "$RUN_DIR" "$role"
    else
      printf '%s: not running\n' "$role"
    fi
  done
  exit 0
fi

# ---------------------------------------------------------------------------------------------
# Models and layout

case "$PAIR" in
  default) pair_strong="openai/gpt-oss-120b"; pair_weak="meta-llama/Llama-3.2-1B-Instruct" ;;
  A|a) pair_strong="openai/gpt-oss-120b"; pair_weak="google/gemma-3-4b-it" ;;
  B|b) pair_strong="meta-llama/Llama-3.3-70B-Instruct"; pair_weak="meta-llama/Llama-3.2-1B-Instruct" ;;
  *) die "unknown pair '$PAIR' (default, A, B)" ;;
esac
STRONG_MODEL="${STRONG_MODEL:-$pair_strong}"
WEAK_MODEL="${WEAK_MODEL:-$pair_weak}"

case "$LAYOUT" in
  one-gpu)
    STRONG_GPUS="${STRONG_GPUS:-0}"; WEAK_GPUS="${WEAK_GPUS:-0}"
    STRONG_MEM="${STRONG_MEM:-0.77}"; WEAK_MEM="${WEAK_MEM:-0.15}" ;;
  node8|multi-node)
    STRONG_GPUS="${STRONG_GPUS:-0,1,2,3,4,5,6}"; WEAK_GPUS="${WEAK_GPUS:-7}"
    STRONG_MEM="${STRONG_MEM:-0.90}"; WEAK_MEM="${WEAK_MEM:-0.90}" ;;
  *) die "unknown layout '$LAYOUT' (one-gpu, node8, multi-node)" ;;
esac
case "$STRONG_DP_MODE" in
  replicas|vllm) ;;
  *) die "unknown --strong-dp '$STRONG_DP_MODE' (replicas, vllm)" ;;
esac
STRONG_MAX_MODEL_LEN="${STRONG_MAX_MODEL_LEN:-$MAX_MODEL_LEN}"
WEAK_MAX_MODEL_LEN="${WEAK_MAX_MODEL_LEN:-$MAX_MODEL_LEN}"
STRONG_MAX_NUM_SEQS="${STRONG_MAX_NUM_SEQS:-$MAX_NUM_SEQS}"
WEAK_MAX_NUM_SEQS="${WEAK_MAX_NUM_SEQS:-$MAX_NUM_SEQS}"

for pair in "strong port:$STRONG_PORT" "weak port:$WEAK_PORT" "strong tp:$STRONG_TP" \
            "max-model-len:$STRONG_MAX_MODEL_LEN" "max-model-len:$WEAK_MAX_MODEL_LEN" \
            "max-num-seqs:$STRONG_MAX_NUM_SEQS" "max-num-seqs:$WEAK_MAX_NUM_SEQS" \
            "wait-timeout:$WAIT_TIMEOUT" "wait interval:$WAIT_INTERVAL" "nodes:$NODES"; do
  is_uint "${pair#*:}" && (( ${pair#*:} > 0 )) || die "${pair%%:*} must be a positive integer, got '${pair#*:}'"
done
is_gpu_list "$STRONG_GPUS" || die "strong GPUs must be a list like 0,1,2, got '$STRONG_GPUS'"
is_gpu_list "$WEAK_GPUS" || die "weak GPUs must be a list like 7, got '$WEAK_GPUS'"
is_fraction "$STRONG_MEM" || die "strong memory fraction must be in (0, 1), got '$STRONG_MEM'"
is_fraction "$WEAK_MEM" || die "weak memory fraction must be in (0, 1), got '$WEAK_MEM'"
[[ "$HOST" =~ ^[A-Za-z0-9.:_-]+$ ]] || die "host '$HOST' is not an address"

IFS=, read -r -a strong_gpu_list <<<"$STRONG_GPUS"
IFS=, read -r -a weak_gpu_list <<<"$WEAK_GPUS"
STRONG_DP=$(( ${#strong_gpu_list[@]} / STRONG_TP ))
(( STRONG_DP >= 1 )) || die "--strong-tp $STRONG_TP needs at least $STRONG_TP strong GPUs, got $STRONG_GPUS"
used=$(( STRONG_DP * STRONG_TP ))
if (( used < ${#strong_gpu_list[@]} )); then
  note "using $used of the ${#strong_gpu_list[@]} strong GPUs ($STRONG_DP replicas x tensor parallel $STRONG_TP)"
  STRONG_GPUS="$(IFS=,; echo "${strong_gpu_list[*]:0:$used}")"
fi
WEAK_TP=${#weak_gpu_list[@]}
# vLLM splits attention heads over tensor-parallel ranks: the pairs' weak models have 32 (Llama-3.2-1B)
# and 8 (gemma-3-4b) query heads, 8 and 4 key-value heads (vLLM replicates key-value heads past
# that), so 1, 2, 4 or 8 GPUs serve both
(( 8 % WEAK_TP == 0 )) || note "warning: the weak server on $WEAK_TP GPUs ($WEAK_GPUS): vLLM needs the tensor" \
  "parallel size to divide the model's attention heads, which 1, 2, 4 or 8 GPUs do for the pairs' weak models"

# The strong servers: one (one replica, or --strong-dp vllm) or one per replica, each on its own
# TP-sized slice of the strong GPUs and its own port; the weak port moves past theirs unless given.
strong_roles=(strong); strong_role_gpus=("$STRONG_GPUS"); strong_ports=("$STRONG_PORT")
if [[ "$STRONG_DP_MODE" == replicas ]] && (( STRONG_DP > 1 )); then
  strong_roles=(); strong_role_gpus=(); strong_ports=()
  for ((r = 0; r < STRONG_DP; r++)); do
    strong_roles+=("strong-$((r + 1))")
    strong_role_gpus+=("$(IFS=,; echo "${strong_gpu_list[*]:$((r * STRONG_TP)):$STRONG_TP}")")
    strong_ports+=("$((STRONG_PORT + r))")
  done
  if (( WEAK_PORT >= STRONG_PORT && WEAK_PORT < STRONG_PORT + STRONG_DP )); then
    [[ -z "$WEAK_PORT_GIVEN" ]] \
      || die "the weak port $WEAK_PORT is one of the strong replicas' ports ($STRONG_PORT-$((STRONG_PORT + STRONG_DP - 1)))"
    WEAK_PORT=$((STRONG_PORT + STRONG_DP))
  fi
fi
(( STRONG_PORT != WEAK_PORT )) || die "the strong and weak servers need different ports (both $STRONG_PORT)"
for port in "${strong_ports[@]}" "$WEAK_PORT"; do
  (( port <= 65535 )) || die "port $port is past 65535 (the strong replicas take --strong-port and the ports after it)"
done
# vLLM's gpt-oss asserts that its MoE intermediate size (2880) divides the torch world size, which
# under --data-parallel-size is data x tensor parallel ranks (vllm model_executor/models/gpt_oss.py)
gpt_oss_ranks_ok() { [[ "$STRONG_MODEL" != *gpt-oss* ]] || (( 2880 % $1 == 0 )); }
in_flight_hint() {  # $1: the data-parallel engines behind the one strong URL (none if they cannot load)
  (( $1 > 1 )) && gpt_oss_ranks_ok $(( $1 * STRONG_TP )) || return 0
  echo "# the strong URL fronts $1 engines of --max-num-seqs $STRONG_MAX_NUM_SEQS: in the client's --live-config," \
       "strong_max_in_flight = $(( $1 * STRONG_MAX_NUM_SEQS )) (max_in_flight, default 256, caps each server)"
}
server_ranks=$STRONG_TP  # the torch world size of one strong server
[[ "$STRONG_DP_MODE" == vllm ]] && server_ranks=$((STRONG_DP * STRONG_TP))
if ! gpt_oss_ranks_ok "$server_ranks"; then
  note "warning: $STRONG_MODEL on $server_ranks ranks per server (data x tensor parallel): vLLM's gpt-oss"\
       "needs the ranks to divide 2880 and will fail to load; give --strong-gpus / --strong-tp / --strong-dp"\
       "so that they do (replicas of tensor parallel 1, 2 or 4 do)"
fi

# Two servers sharing a GPU must leave room for each other (the sum near 0.92).
shared_gpu=0
for g in "${strong_gpu_list[@]}"; do
  for w in "${weak_gpu_list[@]}"; do [[ "$g" == "$w" ]] && shared_gpu=1; done
done
if (( shared_gpu )); then
  total=$(awk -v a="$STRONG_MEM" -v b="$WEAK_MEM" 'BEGIN { printf "%.2f", a + b }')
  awk -v t="$total" 'BEGIN { exit !(t > 0.95) }' \
    && die "the two servers share a GPU and ask for $STRONG_MEM + $WEAK_MEM = $total of its memory (keep the sum near 0.92)"
fi

if [[ "$STRONG_MODEL" == *Llama-3.3-70B* && "$LAYOUT" == one-gpu && "$STRONG_TP" == 1 ]]; then
  note "warning: $STRONG_MODEL in bf16 (~132 GiB) does not fit in $STRONG_MEM of one GPU;" \
       "use --layout node8 --strong-tp 2 (or an FP8 checkpoint via --strong-model)"
fi

is_gated() {  # Hugging Face repos that need an accepted licence and a token (a local dir does not)
  [[ -d "$1" ]] && return 1
  [[ "$1" == meta-llama/* || "$1" == google/gemma* ]]
}

# ---------------------------------------------------------------------------------------------
# Commands

if [[ "$LAYOUT" == multi-node && "$HOST" == 127.0.0.1 ]]; then
  HOST=0.0.0.0  # the client runs elsewhere: servers of a multi-node layout must be reachable
fi

strong_cmd=(vllm serve "$STRONG_MODEL" --served-model-name strong --host "$HOST" --port "$STRONG_PORT"
  --gpu-memory-utilization "$STRONG_MEM" --max-model-len "$STRONG_MAX_MODEL_LEN"
  --max-num-seqs "$STRONG_MAX_NUM_SEQS" --enable-prefix-caching --enable-prompt-tokens-details
  --generation-config vllm)
(( STRONG_TP > 1 )) && strong_cmd+=(--tensor-parallel-size "$STRONG_TP")
[[ "$STRONG_DP_MODE" == vllm ]] && (( STRONG_DP > 1 )) && strong_cmd+=(--data-parallel-size "$STRONG_DP")
strong_cmd_at() {  # port -> strong_at: the strong command serving on that port
  strong_at=("${strong_cmd[@]}")
  local k
  for ((k = 0; k < ${#strong_at[@]}; k++)); do
    [[ "${strong_at[k]}" == --port ]] && strong_at[k + 1]="$1"
  done
  return 0
}
weak_cmd=(vllm serve "$WEAK_MODEL" --served-model-name weak --host "$HOST" --port "$WEAK_PORT"
  --gpu-memory-utilization "$WEAK_MEM" --max-model-len "$WEAK_MAX_MODEL_LEN"
  --max-num-seqs "$WEAK_MAX_NUM_SEQS" --enable-prefix-caching --enable-prompt-tokens-details
  --generation-config vllm)
(( WEAK_TP > 1 )) && weak_cmd+=(--tensor-parallel-size "$WEAK_TP")

show() {  # a command as one pasteable line (GPU list first)
  local gpus="$1"
  shift
  printf 'CUDA_VISIBLE_DEVICES=%s' "$gpus"
  printf ' %q' "$@"
  printf '\n'
}

probe_host() { [[ "$HOST" == 0.0.0.0 || "$HOST" == "::" ]] && echo 127.0.0.1 || echo "$HOST"; }

if [[ "$LAYOUT" == multi-node ]]; then
  if [[ -n "$NODE_HOSTS" ]]; then
    IFS=, read -r -a hosts <<<"$NODE_HOSTS"
  else
    hosts=()
    for ((k = 1; k <= NODES; k++)); do hosts+=("NODE$k"); done
  fi
  head="${HEAD_ADDRESS:-${hosts[0]}}"
  n=${#hosts[@]}
  strong_urls=""; weak_urls=""
  for h in "${hosts[@]}"; do
    for port in "${strong_ports[@]}"; do strong_urls+="${strong_urls:+,}http://$h:$port/v1"; done
    weak_urls+="${weak_urls:+,}http://$h:$WEAK_PORT/v1"
  done
  echo "# multi-node, option 1: one independent server pair per node (simplest; the client spreads calls)"
  echo "# on each of the $n nodes (${hosts[*]}):"
  printf '%q --layout node8 --host 0.0.0.0' "serving/vllm_pair.sh"
  (( ${#FORWARD[@]} )) && printf ' %q' "${FORWARD[@]}"  # the models, ports, sizes given here
  printf '\n'
  echo "#   (with the MESHHEAL_* variables of this shell, if any, set there too)"
  echo "# then give the live client every node's URL (round-robin per role):"
  echo "#   --strong-url $strong_urls"
  echo "#   --weak-url $weak_urls"
  echo "# multi-node, option 2: one strong server spanning the nodes with vLLM's data parallelism"
  echo "# ($STRONG_DP replicas per node, $((STRONG_DP * n)) in all; the head node serves the API)"
  if ! gpt_oss_ranks_ok $((STRONG_DP * n * STRONG_TP)); then
    echo "# warning: vLLM's gpt-oss needs data x tensor parallel ranks to divide its MoE width 2880;"
    echo "# $((STRONG_DP * n * STRONG_TP)) do not, so this option fails to load it (give --strong-gpus / --strong-tp"
    echo "# whose product over the nodes divides 2880, or use option 1)"
  fi
  dp_common=(--data-parallel-size "$((STRONG_DP * n))" --data-parallel-size-local "$STRONG_DP"
    --data-parallel-address "$head" --data-parallel-rpc-port 13345)
  echo "# head node (${hosts[0]}):"
  head_cmd=()
  skip=0
  for a in "${strong_cmd[@]}"; do  # the one-node --data-parallel-size gives way to dp_common
    if (( skip )); then skip=0; continue; fi
    if [[ "$a" == --data-parallel-size ]]; then skip=1; continue; fi
    head_cmd+=("$a")
  done
  show "$STRONG_GPUS" "${head_cmd[@]}" "${dp_common[@]}"
  for ((k = 1; k < n; k++)); do
    echo "# node $((k + 1)) (${hosts[k]}):"
    tp=()  # every engine of one data-parallel group has the head's tensor-parallel size
    (( STRONG_TP > 1 )) && tp=(--tensor-parallel-size "$STRONG_TP")
    show "$STRONG_GPUS" vllm serve "$STRONG_MODEL" --headless "${dp_common[@]}" \
      --data-parallel-start-rank "$((k * STRONG_DP))" --gpu-memory-utilization "$STRONG_MEM" \
      --max-model-len "$STRONG_MAX_MODEL_LEN" --max-num-seqs "$STRONG_MAX_NUM_SEQS" \
      --enable-prefix-caching --generation-config vllm ${tp[@]+"${tp[@]}"}
  done
  echo "# (on a Ray cluster instead: the head-node command alone, with --data-parallel-backend ray added)"
  echo "# the weak model on GPU $WEAK_GPUS of each node:"
  show "$WEAK_GPUS" "${weak_cmd[@]}"
  echo "# then: --strong-url http://$head:$STRONG_PORT/v1 --weak-url $weak_urls"
  in_flight_hint $((STRONG_DP * n))
  echo "# every node needs HF_TOKEN in its environment for gated models (meta-llama/*, google/gemma-*)"
  exit 0
fi

if is_gated "$STRONG_MODEL" || is_gated "$WEAK_MODEL"; then
  gated=""
  is_gated "$STRONG_MODEL" && gated="$STRONG_MODEL"
  is_gated "$WEAK_MODEL" && gated="${gated:+$gated and }$WEAK_MODEL"
  if [[ -z "${HF_TOKEN:-}${HUGGING_FACE_HUB_TOKEN:-}" ]]; then
    if (( DRY_RUN )); then
      note "note: HF_TOKEN is not set; a real start would refuse ($gated is gated)"
    else
      die "refusing to start: $gated is a gated model on Hugging Face and HF_TOKEN is not set." \
          "Accept the licence on the model's page, then 'export HF_TOKEN=<your token>' (or pass a local model directory)."
    fi
  fi
fi

ph="$(probe_host)"
strong_urls=""
for port in "${strong_ports[@]}"; do strong_urls+="${strong_urls:+,}http://$ph:$port/v1"; done
if (( DRY_RUN )); then
  echo "# layout $LAYOUT: strong $STRONG_MODEL, weak $WEAK_MODEL; logs and PIDs in ${RUN_DIR#"$PWD"/}"
  for r in "${!strong_roles[@]}"; do
    strong_cmd_at "${strong_ports[r]}"
    show "${strong_role_gpus[r]}" "${strong_at[@]}"
  done
  if (( ${#strong_ports[@]} == 1 )); then
    echo "# wait until GET http://$ph:$STRONG_PORT/health is 200 and /v1/models lists 'strong' (timeout ${WAIT_TIMEOUT}s)"
  else
    echo "# wait until GET /health is 200 and /v1/models lists 'strong' on each of ports" \
         "${strong_ports[0]}-${strong_ports[-1]} of $ph (timeout ${WAIT_TIMEOUT}s each)"
  fi
  show "$WEAK_GPUS" "${weak_cmd[@]}"
  echo "# wait until GET http://$ph:$WEAK_PORT/health is 200 and /v1/models lists 'weak' (timeout ${WAIT_TIMEOUT}s)"
  echo "# client: --strong-url $strong_urls --weak-url http://$ph:$WEAK_PORT/v1"
  [[ "$STRONG_DP_MODE" == vllm ]] && in_flight_hint "$STRONG_DP"
  exit 0
fi

# ---------------------------------------------------------------------------------------------
# Start: strong first, ready, then weak

command -v vllm >/dev/null 2>&1 || die "the 'vllm' command is not installed here (pip install -e .[serve] on a CUDA machine)"
command -v curl >/dev/null 2>&1 || die "curl is needed to wait for the servers"
if command -v nvidia-smi >/dev/null 2>&1 && [[ "$STRONG_MODEL" == *gpt-oss-120b* ]]; then
  # ~61 GiB of MXFP4 weights and ~2 GiB of overhead must fit in each replica's share of its GPUs
  for r in "${!strong_roles[@]}"; do
    total=0
    IFS=, read -r -a replica_gpus <<<"${strong_role_gpus[r]}"
    for g in "${replica_gpus[@]}"; do
      mib="$( (nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i "$g" 2>/dev/null || true) \
        | head -n 1 | tr -dc 0-9)"
      [[ -n "$mib" ]] || { total=""; break; }
      total=$((total + mib))
    done
    [[ -n "$total" ]] || continue  # nvidia-smi could not say: vLLM will
    share=$(awk -v t="$total" -v f="$STRONG_MEM" 'BEGIN { printf "%d", t * f }')
    if (( share < 64512 )); then
      die "GPU(s) ${strong_role_gpus[r]} have $((total / 1024)) GiB; $STRONG_MEM of them ($((share / 1024)) GiB)" \
          "cannot hold $STRONG_MODEL (~61 GiB of weights and ~2 GiB of overhead): use a 141 GB GPU," \
          "--layout node8, or two GPUs per replica (--strong-gpus 0,1 --strong-tp 2)"
    fi
  done
fi
mkdir -p "$RUN_DIR"
mapfile -t recorded < <(recorded_roles)  # this layout's roles, and any other layout's left running
for role in "${strong_roles[@]}" weak "${recorded[@]}"; do
  if pid="$(running_pid "$role")"; then
    die "a $role server started from $RUN_DIR is already running (pid $pid); run '$0 stop' first"
  fi
done

STARTED=()
cleanup() {
  trap - INT TERM
  note "stopping"
  local k
  for ((k = ${#STARTED[@]} - 1; k >= 0; k--)); do stop_role "${STARTED[k]}"; done  # weak first
}
trap 'cleanup; exit 130' INT TERM

launch() {  # role gpus cmd... -> background process (its own process group), PID and log in RUN_DIR
  local role="$1" gpus="$2"
  shift 2
  local log="$RUN_DIR/$role.log"
  { printf '# %s  ' "$(date -u +%FT%TZ)"; show "$gpus" "$@"; } >>"$log"
  show "$gpus" "$@"
  CUDA_VISIBLE_DEVICES="$gpus" setsid "$@" >>"$log" 2>&1 </dev/null &
  echo $! >"$(pid_file "$role")"
  STARTED+=("$role")
}

models_lists() {  # host port name: does GET /v1/models list the served name?
  local reply
  if [[ -n "${VLLM_API_KEY:-}" ]]; then  # the key goes through stdin, never the process list
    reply="$(printf 'header = "Authorization: Bearer %s"\n' "$VLLM_API_KEY" \
      | curl -fsS -m 5 -K - "http://$1:$2/v1/models" 2>/dev/null)" || return 1
  else
    reply="$(curl -fsS -m 5 "http://$1:$2/v1/models" 2>/dev/null)" || return 1
  fi
  grep -Eq "\"id\"[[:space:]]*:[[:space:]]*\"$3\"" <<<"$reply"
}

wait_ready() {  # role port [served name: the role's]
  local role="$1" port="$2" name="${3:-$1}" host pid code waited=0
  host="$(probe_host)"
  pid="$(<"$(pid_file "$role")")"
  note "waiting for the $role server on http://$host:$port (timeout ${WAIT_TIMEOUT}s; log $RUN_DIR/$role.log)"
  while (( waited < WAIT_TIMEOUT )); do
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 20 "$RUN_DIR/$role.log" >&2 || true
      cleanup
      die "the $role server exited during start-up (log: $RUN_DIR/$role.log)"
    fi
    code="$(curl -s -o /dev/null -m 5 -w '%{http_code}' "http://$host:$port/health" 2>/dev/null || true)"
    if [[ "$code" == 200 ]] && models_lists "$host" "$port" "$name"; then
      note "$role server ready: http://$host:$port/v1"
      return 0
    fi
    sleep "$WAIT_INTERVAL"
    waited=$((waited + WAIT_INTERVAL))
  done
  cleanup
  die "the $role server was not ready after ${WAIT_TIMEOUT}s (log: $RUN_DIR/$role.log)"
}

for r in "${!strong_roles[@]}"; do  # replicas on their own GPUs start together
  strong_cmd_at "${strong_ports[r]}"
  launch "${strong_roles[r]}" "${strong_role_gpus[r]}" "${strong_at[@]}"
done
for r in "${!strong_roles[@]}"; do wait_ready "${strong_roles[r]}" "${strong_ports[r]}" strong; done
launch weak "$WEAK_GPUS" "${weak_cmd[@]}"
wait_ready weak "$WEAK_PORT"

echo "both servers ready; live client: --strong-url $strong_urls --weak-url http://$ph:$WEAK_PORT/v1"
[[ "$STRONG_DP_MODE" == vllm ]] && in_flight_hint "$STRONG_DP"
if (( DETACH )); then
  echo "detached; stop them with: $0 stop --run-dir $RUN_DIR"
  trap - INT TERM
  exit 0
fi
echo "Ctrl-C stops both servers"
while true; do
  for role in "${STARTED[@]}"; do
    if ! running_pid "$role" >/dev/null; then
      note "the $role server stopped (log: $RUN_DIR/$role.log)"
      cleanup
      exit 1
    fi
  done
  sleep "$WAIT_INTERVAL"
done
