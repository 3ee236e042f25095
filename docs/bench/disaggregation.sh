#!/bin/bash
# Colocated vs 1P1D on the same host, the same mixed workload: 64 requests at 1 req/s cycling
# disaggregation_workload.jsonl (25 short chats, 5 long documents). JSON in $OUT (default /tmp/pdbench).
cd "$(dirname "$0")/../.." && mkdir -p "${OUT:-/tmp/pdbench}"
B=.venv/bin/cadenza
for mode in colocated pd; do
  port=$((18100 + RANDOM % 500))
  extra=""
  if [ $mode = pd ]; then extra="--disaggregation 1P1D --num-cpus-per-worker 1"; fi
  $B serve --port $port --num-blocks 1024 $extra > ${OUT:-/tmp/pdbench}/serve_$mode.log 2>&1 &
  pid=$!
  for i in $(seq 1 180); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
  $B bench serve --url http://127.0.0.1:$port --dataset docs/bench/disaggregation_workload.jsonl --request-rate 1 --seed 0 --output ${OUT:-/tmp/pdbench}/$mode.json > ${OUT:-/tmp/pdbench}/bench_$mode.log 2>&1
  curl -sf http://127.0.0.1:$port/stats > ${OUT:-/tmp/pdbench}/stats_$mode.json
  kill $pid; wait $pid
done
echo finished
