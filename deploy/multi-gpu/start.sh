#!/usr/bin/env bash
# One engine per GPU on a multi-GPU host: one process per GPU, each pinned to its GPU by
# CUDA_VISIBLE_DEVICES (it sees that GPU as cuda:0 and nothing else), so no two engines share a
# GPU's memory or SMs and a crash takes one GPU's calls down, not the host's.
#
#   deploy/multi-gpu/start.sh serve   # breezert serve per GPU on ports BASE_PORT+i (replicas)
#   deploy/multi-gpu/start.sh agent   # one LiveKit agent worker per GPU, each with its engine
#   ... --dry-run                     # print the commands only
#
# serve: point the agents at every replica, TTS(base_url=["http://host:8080", "http://host:8081",
#        ...]) (BREEZERT_URL=comma,separated for examples/livekit_agent.py), or put them behind
#        a load balancer that routes on /readyz.
# agent: every worker registers with LiveKit on its own; its load_fnc (breezert_agent.engine_load)
#        reports its GPU's engine, so the dispatcher fills the GPUs evenly and skips a full one.
#
# Environment: NUM_GPUS (default: nvidia-smi -L), CONFIG (default configs/h200-latency.toml),
# MODEL (serve: checkpoint folder, default /model; agent: set model.path in CONFIG), HOST and
# BASE_PORT (serve: 127.0.0.1, 8080), BREEZERT_AUTH_TOKEN (serve: required off loopback),
# WORKER_BASE_PORT (agent health ports: 9081), AGENT (agent: examples/livekit_agent.py, with
# LIVEKIT_URL, LIVEKIT_API_KEY, LIVEKIT_API_SECRET), LOG_DIR (default .cache/multi-gpu).
# Ctrl-C / SIGTERM stops every process (each drains: serve within its --shutdown-grace).
set -euo pipefail
cd "$(dirname "$0")/../.."

mode="${1:-}"
dry_run=0
[ "${2:-}" = "--dry-run" ] && dry_run=1
case "$mode" in serve|agent) ;; *) echo "usage: $0 serve|agent [--dry-run]" >&2; exit 2;; esac

num_gpus="${NUM_GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)}"
if [ "${num_gpus:-0}" -lt 1 ]; then echo "no GPU found (set NUM_GPUS)" >&2; exit 1; fi
config="${CONFIG:-configs/h200-latency.toml}"
model="${MODEL:-/model}"
log_dir="${LOG_DIR:-.cache/multi-gpu}"
pids=()

launch() {  # launch GPU_INDEX command...
  local gpu="$1"; shift
  if [ "$dry_run" = 1 ]; then
    echo "CUDA_VISIBLE_DEVICES=$gpu $*"
    return
  fi
  mkdir -p "$log_dir"
  CUDA_VISIBLE_DEVICES="$gpu" "$@" >"$log_dir/$mode-gpu$gpu.log" 2>&1 &
  pids+=("$!")
}

for ((i = 0; i < num_gpus; i++)); do
  if [ "$mode" = serve ]; then
    launch "$i" breezert serve --config "$config" --model "$model" --device cuda \
      --host "${HOST:-127.0.0.1}" --port "$(( ${BASE_PORT:-8080} + i ))"
  else
    launch "$i" env BREEZERT_CONFIG="$config" \
      BREEZERT_WORKER_PORT="$(( ${WORKER_BASE_PORT:-9081} + i ))" python "${AGENT:-examples/livekit_agent.py}" start
  fi
done
[ "$dry_run" = 1 ] && exit 0

echo "started ${#pids[@]} $mode process(es), one per GPU; logs in $log_dir"
trap 'kill -TERM "${pids[@]}" 2>/dev/null || true' INT TERM
wait
