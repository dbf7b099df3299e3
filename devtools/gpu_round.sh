#!/bin/bash
# One call on a lent GPU machine (the `device` tool of this workplace, or any CUDA box with this tree):
# generates the qwen3-30b-a3b test file, times `bench-engine --distinct` for each setting (off, on: `--dense-copies`;
# tiles: `--dense-copies on --dense-tiles on`), then the server's round of 8 (`strata-desk bench`, parallel 8, 128
# tokens, 8 concurrent first: the steady state, the conversation store full for one at a time) for each server arm
# (copies; plain: none; tiles: `--dense-tiles on`), within LIMIT seconds. Each arm's engine log (its parks,
# `parking: parked N tokens in X ms`) is kept in $OUT.
#
#   ENGINE_ARMS="on tiles" ARMS="copies tiles" ROUNDS=8 LIMIT=560 bash devtools/gpu_round.sh
#
# Where the machine cannot install packages, carry them as wheels for its Python (3.12 there):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     gguf starlette uvicorn h11 anyio sniffio idna httpx httpcore certifi pydantic pydantic-core annotated-types \
#     typing-inspection typing-extensions platformdirs prometheus-client psutil nvidia-ml-py textual rich \
#     markdown-it-py mdurl mdit-py-plugins linkify-it-py uc-micro-py pygments pytest pluggy iniconfig pytest-asyncio \
#     pytest-xdist execnet pyyaml tqdm click
# (`.whl/` is ignored by git; the script installs it to /tmp/site when it is there.)
set -u
cd "$(dirname "$0")/.."
START=$(date +%s); LIMIT=${LIMIT:-540}
left() { echo $(( LIMIT - ($(date +%s) - START) )); }
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache} STRATA_DESK_HOME=$(mktemp -d)
OUT=${OUT:-$(mktemp -d)}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
M=/tmp/q30-12-q4km.gguf
[ -f $M ] || python3 -m strata_desk make-test-model $M --preset qwen3-30b-a3b --layers 12 --dtype q4_k_m \
  --router-skew 1.0 > /dev/null || exit 1
echo "model ready at $(( $(date +%s) - START )) s"
for copies in ${ENGINE_ARMS-off on}; do
  [ "$(left)" -lt 80 ] && break
  flags="--dense-copies $copies"; [ "$copies" = tiles ] && flags="--dense-copies on --dense-tiles on"
  echo "== bench-engine --distinct $flags"
  timeout $(( $(left) - 10 )) python3 -m engine.bench --model $M --device cuda --slots 8 --distinct --prompt 512 \
    --decode 64 $flags 2>&1 | grep -E "tok/s|copies|rows|Error"
done
port=8190
for arm in ${ARMS-copies plain}; do
  [ "$(left)" -lt 60 ] && break
  port=$((port + 1))
  dense=true; [ "$arm" = plain ] && dense=false
  tiles=off; [ "$arm" = tiles ] && tiles=on
  echo "{\"model\": \"$M\", \"parallel\": 8, \"context\": 4096, \"port\": $port, \"prefill\": \"auto\", \"dense_copies\": $dense, \"args\": [\"--dense-tiles\", \"$tiles\"], \"log\": \"$OUT/$arm-engine.log\"}" \
    > $OUT/$arm.json
  python3 -m server --config $OUT/$arm.json > $OUT/$arm-server.log 2>&1 &
  pid=$!
  for _ in $(seq 600); do curl -sf localhost:$port/health > /dev/null && break; sleep 0.5; done
  echo "== server, arm $arm (dense_copies $dense, --dense-tiles $tiles), ready at $(( $(date +%s) - START )) s"
  timeout $(( $(left) > 30 ? $(left) - 20 : 10 )) python3 -m strata_desk bench --url http://127.0.0.1:$port \
    --concurrency 8,1 --max-tokens 128 --rounds ${ROUNDS:-3} --prompt-words 200 --out $OUT/$arm-bench.json 2>&1 \
    | grep -v "^$" | tail -7
  kill $pid; wait $pid 2>/dev/null
done
echo "done at $(( $(date +%s) - START )) s; results in $OUT"
