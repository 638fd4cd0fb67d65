#!/usr/bin/env bash
# Issue 41's check of the CUDA path, in one command on a bare GPU machine (docs/gpu.md, "Checking a GPU"):
#
#     OUT=/some/dir [GPU_CHECK_SECONDS=480] [GPU_CHECK_SKIP="part ..."] [GPU_CHECK_BUNDLE=1] \
#         bash scripts/gpu_check.sh
#
# 1. installs the wheels carried in .gpu/wheels (`make gpu-folder` fetches them) into /tmp/site;
# 2. runs the tests that need CUDA (graphs captured and replayed, steps launched ahead, no host wait in
#    a step, a draft model's guesses, the quantized layers' and host lists' CUDA paths);
# 3. greedy float32 text of the engine against model.generate (scripts/check_greedy_exact.py);
# 4. scripts/bench_engine.py on a random 1B Llama, bfloat16, at 1, 8 and 32 rows with decode steps as
#    CUDA graphs launched ahead, as graphs not launched ahead, and eager, the kernels, launches and host
#    waits of a step, and transformers' compiled static-cache generate at a batch of 32 as the baseline;
# 5. scripts/benchmark.py: the server through HTTP at 32 streams against the engine's own ceiling, and
#    scripts/bench_frontend.py: the frontend worker's CPU time a token on this host, on the mock backend;
# 6. in the time left, the engine on the 1B with --compile (the compiled decode step, captured) against
#    it without, then on a random 8B Llama at 1 and 32 rows against the weight-read floor, then the 8B
#    with --quantize fp8 (FP8 products) and the 1B written as an FP8 checkpoint in 128 x 128 blocks.
#
# Each part runs under its own time limit, so that one that hangs or breaks leaves the others' figures;
# every result and log goes under $OUT, and $OUT/summary.txt says how each part ended. On a machine
# without CUDA it runs too, on a tiny Llama, and says that the CUDA parts were skipped (tests/
# test_gpu_check.py keeps it runnable). Python is $PYTHON (default python3).
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$(mktemp -d)}
PYTHON=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-$ROOT/.gpu/wheels}
TOKENIZER=${GPU_TOKENIZER:-$ROOT/.gpu/tokenizer}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
export PYTHONUNBUFFERED=1  # a part stopped at its limit keeps the lines it printed
: >"$SUMMARY"

# The whole check ends within $GPU_CHECK_SECONDS (a lent machine's command may run 10 minutes): a part
# gets its own limit or what is left, and none starts with under 30 s left.
DEADLINE=$(($(date +%s) + ${GPU_CHECK_SECONDS:-480}))

# stage NAME SECONDS LOG COMMAND...: the command under its limit, its output to LOG, a line in the summary.
stage() {
    local name=$1 limit=$2 log=$3 started rc
    shift 3
    started=$(date +%s)
    if [[ " ${GPU_CHECK_SKIP:-} " == *" $name "* ]]; then
        echo "$name: skipped (GPU_CHECK_SKIP)" | tee -a "$SUMMARY"
        return
    fi
    if [ $((DEADLINE - started)) -lt 30 ]; then
        echo "$name: not run, out of time" | tee -a "$SUMMARY"
        return
    fi
    [ $((DEADLINE - started)) -lt "$limit" ] && limit=$((DEADLINE - started))
    echo "=== $name: $*" >>"$log"
    timeout -k 10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    echo "$name: exit $rc after $(($(date +%s) - started)) s (limit $limit s; log $(basename "$log"))" | tee -a "$SUMMARY"
}

if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    SIZE=1b ROWS=(1 8 32) TOKENS=128 DTYPE=bfloat16 HTTP_TOKENS=64 STREAMS=32 QUANTIZE=auto FRONTEND_RATE=500
    if [ -d "$WHEELS" ] && [ -n "$(ls "$WHEELS"/*.whl 2>/dev/null)" ]; then
        # The versions this project pins where the machine has others (transformers' internals change).
        stage install 120 "$OUT/check.log" "$PYTHON" -m pip install --quiet --no-index --no-deps \
            --target /tmp/site "$WHEELS"/*.whl
        export PYTHONPATH=/tmp/site
    else
        echo "install: no wheels in $WHEELS: the machine's packages as they are" | tee -a "$SUMMARY"
    fi
else
    # The engine's part quantizes the tiny Llama at load: bench_engine.py's --quantize runs somewhere.
    SIZE=tiny ROWS=(1 4) TOKENS=8 DTYPE=float32 HTTP_TOKENS=8 STREAMS=4 QUANTIZE=int4 FRONTEND_RATE=1000
    echo "no CUDA device: the CUDA parts are skipped (their tests skip themselves), a tiny Llama instead of" \
        "the 1B, quantized to int4 for the engine's part, this environment's packages" | tee -a "$SUMMARY"
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
TOKENIZER_OPTION=()
[ -f "$TOKENIZER/tokenizer.json" ] && TOKENIZER_OPTION=(--tokenizer "$TOKENIZER")

{
    date -u
    nvidia-smi 2>&1 | head -20
    "$PYTHON" -c "import sys, torch, transformers; print(sys.version); print('torch', torch.__version__, \
'cuda', torch.version.cuda, torch.cuda.is_available()); print('transformers', transformers.__version__)"
} >>"$OUT/check.log" 2>&1

stage cuda-tests 180 "$OUT/check.log" "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts= -k cuda \
    tests/backend/test_decode_graphs.py tests/backend/test_steps_ahead.py tests/backend/test_host_lists.py \
    tests/backend/test_draft_model.py tests/backend/test_lora.py \
    tests/backend/test_quantized_weights.py tests/backend/test_group_wise.py tests/backend/test_fp8_weights.py \
    tests/backend/test_fp8_linear.py

stage greedy-exact 120 "$OUT/exact.log" "$PYTHON" scripts/check_greedy_exact.py --size "$SIZE" \
    --max-tokens 32 "${TOKENIZER_OPTION[@]}"

stage engine-$SIZE 300 "$OUT/engine_$SIZE.log" "$PYTHON" scripts/bench_engine.py --random "$SIZE" \
    "${TOKENIZER_OPTION[@]}" --graphs --profile --first-tokens --rows "${ROWS[@]}" --max-tokens "$TOKENS" \
    --prompt-tokens 64 --transformers-static "${ROWS[-1]}" --dtype "$DTYPE" --quantize "$QUANTIZE"

MODEL_DIR=$(mktemp -d)/llama-$SIZE
stage write-model 120 "$OUT/http.log" "$PYTHON" scripts/random_llama.py --out "$MODEL_DIR" --size "$SIZE" \
    --dtype "$DTYPE" "${TOKENIZER_OPTION[@]}"
stage http-$STREAMS 240 "$OUT/http.log" "$PYTHON" scripts/benchmark.py --model "$MODEL_DIR" --dtype "$DTYPE" \
    --quantize none --no-naive --no-plots --concurrency "$STREAMS" --requests 2 --tokens "$HTTP_TOKENS" \
    --out "$OUT/http_report.md" --server-log "$OUT/server.log"
if [ "$SIZE" = 1b ]; then  # longer requests: the first token's wait weighs less beside the decoding
    stage http-$STREAMS-long 240 "$OUT/http.log" "$PYTHON" scripts/benchmark.py --model "$MODEL_DIR" \
        --dtype "$DTYPE" --quantize none --no-naive --no-plots --concurrency "$STREAMS" --requests 2 \
        --tokens 256 --out "$OUT/http_report_long.md" --server-log "$OUT/server.log"
fi
rm -rf "$MODEL_DIR"
# What the frontend's worker carries on this host with no model behind it: its CPU time a token bounds
# what HTTP can carry of the engine's figure (docs/performance.md, "The frontend at thousands of tokens")
stage frontend 60 "$OUT/frontend.log" "$PYTHON" scripts/bench_frontend.py --streams "$STREAMS" \
    --tokens "$HTTP_TOKENS" --rate "$FRONTEND_RATE" --rounds 3

# In the time left: --compile (the compiled decode step, captured), which no lease has had time for yet
# (it is first), then the 8B, measured on an H200 on 2026-12-04, then FP8 products, never run on a GPU.
if [ "$SIZE" = 1b ]; then
    stage compile-1b 200 "$OUT/compile_1b.log" "$PYTHON" scripts/bench_engine.py --random 1b \
        "${TOKENIZER_OPTION[@]}" --compile --rows 1 32 --max-tokens 128 --prompt-tokens 64
    stage engine-8b 300 "$OUT/engine_8b.log" "$PYTHON" scripts/bench_engine.py --random 8b \
        "${TOKENIZER_OPTION[@]}" --graphs --profile --rows 1 32 --max-tokens 64 --prompt-tokens 64
    # FP8 products (--quantize fp8): a byte a weight read where bfloat16 reads two
    stage fp8-8b 240 "$OUT/fp8_8b.log" "$PYTHON" scripts/bench_engine.py --random 8b --quantize fp8 \
        "${TOKENIZER_OPTION[@]}" --graphs --rows 1 32 --max-tokens 64 --prompt-tokens 64
    # an FP8 checkpoint in 128 x 128 blocks, as "-FP8" files are, through the loader (its start's check
    # of the blockwise product, then the layers in the file's blocks or a channel's: engine log)
    FP8_DIR=$(mktemp -d)/llama-1b-fp8
    stage write-fp8-1b 120 "$OUT/fp8_1b.log" "$PYTHON" scripts/random_llama.py --out "$FP8_DIR" --size 1b \
        --fp8 "${TOKENIZER_OPTION[@]}"
    stage fp8-1b 180 "$OUT/fp8_1b.log" "$PYTHON" scripts/bench_engine.py --model "$FP8_DIR" --dtype bfloat16 \
        --graphs --rows 1 32 --max-tokens 128 --prompt-tokens 64
    rm -rf "$FP8_DIR"
fi
echo "done" | tee -a "$SUMMARY"
# A lent machine returns at most 8 files from $OUT, and the check writes ten: GPU_CHECK_BUNDLE=1 packs every
# log and report into $OUT/logs.tgz beside summary.txt.
if [ -n "${GPU_CHECK_BUNDLE:-}" ]; then
    (cd "$OUT" && tar czf logs.tgz --exclude logs.tgz --exclude summary.txt ./* &&
        find . -maxdepth 1 -type f ! -name logs.tgz ! -name summary.txt -delete)
fi
