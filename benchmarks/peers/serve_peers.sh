#!/usr/bin/env bash
# The `deltaserve bench serve` client against deltaserve's server and `transformers serve` on one checkpoint.
#
#   benchmarks/peers/serve_peers.sh CHECKPOINT OUT_DIR [bench serve args...]
#
# Starts each server on 2 threads, one after the other (never both at once: they would share the 2 cores), waits
# for /health, runs the same seeded workload against it and writes OUT_DIR/serve-{deltaserve,transformers}.json.
# `transformers serve` rejects the ignore_eos field and cannot list a local folder under /v1/models, so the client
# sends --no-ignore-eos and --model CHECKPOINT to both (outputs may then end early at eos: compare the usage-based
# token rates, not request rates). transformers serve needs `accelerate` to load a local folder on CPU.
set -euo pipefail
ckpt=$1 out=$2; shift 2
mkdir -p "$out"
py=${PYTHON:-python}  # the venv's python; TRANSFORMERS names its `transformers` CLI
export OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1

wait_healthy() {  # url pid
  for _ in $(seq 600); do
    curl -sf "$1/health" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "server $2 exited during start-up" >&2; return 1; }
    sleep 0.5
  done
  echo "server at $1 not healthy after 300 s" >&2; return 1
}

bench() {  # name port
  "$py" -m deltaserve.cli bench serve --base-url "http://127.0.0.1:$2/v1" --model "$ckpt" --no-ignore-eos \
    --json "$out/serve-$1.json" "${BENCH_ARGS[@]}"
}

BENCH_ARGS=("$@")
start_and_bench() {  # name port command...
  local name=$1 port=$2; shift 2
  "$@" > "$out/$name-server.log" 2>&1 &
  local pid=$!
  if wait_healthy "http://127.0.0.1:$port" "$pid"; then bench "$name" "$port" | tee "$out/serve-$name.txt"; fi
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

# both in the checkpoint's bf16
start_and_bench deltaserve 18601 "$py" -m deltaserve.cli serve "$ckpt" --port 18601 --served-model-name "$ckpt" \
  --dtype bfloat16
start_and_bench transformers 18602 "${TRANSFORMERS:-transformers}" serve "$ckpt" --device cpu --port 18602
