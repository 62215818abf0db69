#!/usr/bin/env bash
# W4 on the GPU: `pagedllm serve` (Qwen3-0.6B architecture, dummy bf16 weights) on loopback, then
# `pagedllm bench serve` at 8, 16, 32 and 64 requests per second (RATES overrides). Results go to
# the folder given, named $W4_NAME (default w4); arguments after it go to the server (e.g.
# --no-engine-process).
set -uo pipefail
OUT=${1:-/tmp/gpu_check}
[ $# -gt 0 ] && shift
RATES=${RATES:-8 16 32 64}
NAME=${W4_NAME:-w4}
PORT=18000
python3 -m pagedllm serve benchmarks/configs/qwen3-0.6b --load-format dummy --max-model-len 1536 \
    --enable-chunked-prefill --max-num-batched-tokens 4096 --port "$PORT" "$@" >"$OUT/${NAME}_server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $server 2>/dev/null || { echo "server died:"; tail -20 "$OUT/${NAME}_server.log"; exit 1; }
    sleep 1
done
python3 -m pagedllm bench serve --base-url "http://127.0.0.1:$PORT" --request-rate $RATES \
    --result-file "$OUT/$NAME.json" --plot-file "$OUT/$NAME.png"
