#!/usr/bin/env bash
# Prefill/decode disaggregation against one instance, on one checkpoint (docs/disaggregation.md):
#
#   benchmarks/pd_vs_one.sh CHECKPOINT OUT_DIR [bench serve args...]     (default args: --concurrency 8 32)
#
# First one `deltaserve serve` alone, then a prefill instance, a decode instance and `deltaserve router` in front;
# the same seeded `deltaserve bench serve` workload against each (never both setups at once), written to
# OUT_DIR/pd-{one,router}.json, then each point's router/one ratios of throughput, TTFT p50 and ITL p50. On one
# machine the two instances share its cores with each other: this measures what the extra hop and the transfers
# cost, not what separate machines would gain.
set -euo pipefail
ckpt=$1 out=$2; shift 2
mkdir -p "$out"
py=${PYTHON:-python}
export OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--concurrency 8 32)
serve=("$py" -m deltaserve.cli serve "$ckpt" --served-model-name m)
pids=()

wait_healthy() {  # url
  for _ in $(seq 600); do
    curl -sf "$1/health" >/dev/null && return 0
    sleep 0.5
  done
  echo "$1 not healthy after 300 s" >&2; return 1
}

stop_all() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  pids=()
}
trap stop_all EXIT

bench() {  # name port
  "$py" -m deltaserve.cli bench serve --base-url "http://127.0.0.1:$2/v1" --model m --api completions \
    --json "$out/pd-$1.json" "${args[@]}" | tee "$out/pd-$1.txt"
}

"${serve[@]}" --port 8301 > "$out/one.log" 2>&1 & pids+=($!)
wait_healthy http://127.0.0.1:8301 && bench one 8301
stop_all

"${serve[@]}" --port 8302 --kv-transfer-config '{"kv_role": "kv_producer"}' > "$out/prefill.log" 2>&1 & pids+=($!)
"${serve[@]}" --port 8303 --kv-transfer-config '{"kv_role": "kv_consumer"}' > "$out/decode.log" 2>&1 & pids+=($!)
"$py" -m deltaserve.cli router --prefill http://127.0.0.1:8302 --decode http://127.0.0.1:8303 --port 8304 \
  > "$out/router.log" 2>&1 & pids+=($!)
wait_healthy http://127.0.0.1:8304 && bench router 8304
stop_all

"$py" - "$out/pd-one.json" "$out/pd-router.json" <<'PY'
import json, sys
one, routed = (json.load(open(p)) for p in sys.argv[1:])
print(f"{'point':>8} {'metric':>18} {'one':>10} {'router':>10} {'router/one':>10}")
for a, b in zip(one["points"], routed["points"]):
    point = a.get("concurrency", a.get("request_rate"))
    for m in ("output_throughput", "ttft_p50_s", "itl_p50_s"):
        x, y = a["summary"][m]["median"], b["summary"][m]["median"]
        print(f"{point:>8} {m:>18} {x:>10.4g} {y:>10.4g} {y / x:>10.3f}")
PY
