#!/usr/bin/env bash
# Every GPU measurement in one call, for the short, occasional GPU time rose gets:
#   OUT=/tmp/rose-gpu bash benchmarks/gpu.sh            # about 9 minutes on one GPU
#   OUT=/tmp/rose-dry bash benchmarks/gpu.sh --dry-run  # every stage on the CPU, tiny shapes
#   GPU_SH_MORE=1 bash benchmarks/gpu.sh                # also the earlier training extras
# Needs, beside the repository:
# * .peers/tiktoken_cache: the GPT-2 BPE files (tiktoken reads them offline);
# * .peers/nanoGPT: a copy of nanoGPT's repository (train.py, model.py, configurator.py,
#   unchanged), for the training step beside rose's (skipped, and said, without it);
# * .whl/: wheels of transformers and what it needs beyond torch, for its continuous
#   batching beside the engine (the GPU machine reaches no package index); made on a
#   machine that does, for the GPU machine's Python, with
#     pip download --only-binary=:all: --python-version 3.11 -d .whl transformers==5.25.0
#   (its dependencies come along) and installed here with pip --no-index (without it,
#   the transformers figure says it was skipped).
# Each step writes its output to $OUT as it goes and has a time limit of its own (the
# limits add up to under 10 minutes), and every figure is appended to $OUT/results.jsonl
# the moment it is measured, so a run cut short still returns what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/rose-gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/rose-inductor
export TIKTOKEN_CACHE_DIR="${TIKTOKEN_CACHE_DIR:-$PWD/.peers/tiktoken_cache}"
RESULTS="$OUT/results.jsonl"

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
if [ "$DRY" = 1 ]; then  # the same stages on the CPU, tiny shapes, short limits
    DEVICE=cpu TINY=--tiny
else
    DEVICE=cuda TINY=
fi

step() {  # step NAME SECONDS COMMAND...: run it, its output to the screen and $OUT/NAME.txt
    local name=$1 limit=$(( $2 * (DRY + 1) ))  # (a dry run compiles on a CPU: twice the time)
    shift 2
    echo "== $name ($(date +%T), at most ${limit}s): $*"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    echo "== $name: exit ${PIPESTATUS[0]}"
}
stage() {  # stage NAME SECONDS: one stage of benchmarks.gpu_inference
    step "$1" "$2" python -m benchmarks.gpu_inference "$1" --device "$DEVICE" $TINY \
        --results "$RESULTS"
}

{ if [ "$DRY" = 1 ]; then echo "dry run on the CPU"; else
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  lscpu | grep -m1 'Model name'; } | tee "$OUT/machine.txt"

if [ -d .whl ] && ! python -c "import transformers" 2>/dev/null; then
    step wheels 40 python -m pip install --no-index --find-links .whl transformers
fi

# Inference: the card's bandwidth first (the roofline divides by it), then batch-1
# decode against that roofline, the engine offline, and the server.
stage bandwidth 30
stage decode 140
stage engine 150
stage serve 100

# Training: rose beside nanoGPT's train.py, GPT-2 124M, 12 x 1024, bfloat16, compiled.
if [ "$DRY" = 1 ]; then
    step train 120 python -m benchmarks.train --device cpu --quick
elif [ -d .peers/nanoGPT ]; then
    step train 110 python -m benchmarks.train --device cuda --dtype bfloat16 --presets gpt2 \
        --batch-size 12 --compile --steps 10 --warmup-steps 3 --checkpointing off \
        --nanogpt .peers/nanoGPT
else
    echo "== train: .peers/nanoGPT is missing: rose alone"
    step train 90 python -m benchmarks.train --device cuda --dtype bfloat16 --presets gpt2 \
        --batch-size 12 --compile --steps 10 --warmup-steps 3 --checkpointing off
fi

[ "${GPU_SH_MORE:-0}" = 1 ] || { echo "== done: $RESULTS"; exit 0; }
# The loss a slice of rows at a time beside the plain one, and the vocabulary unpadded
# (issue 53's item 5), then the earlier measurements (docs/benchmarks.md), when there is time.
step train-loss 120 python -m benchmarks.train --device cuda --dtype bfloat16 --presets gpt2 \
    --batch-size 12 --compile --steps 10 --warmup-steps 3 --checkpointing off --loss chunked,plain
step train-unpadded 90 python -m benchmarks.train --device cuda --dtype bfloat16 --presets gpt2 \
    --batch-size 12 --compile --steps 20 --warmup-steps 5 --checkpointing off --vocab-multiple 1
step offload 90 python -m benchmarks.offload --device cuda --json "$OUT/offload.json"
step engine-check 60 python -m benchmarks.gpu_engine_check
step cuda-tests 60 python -m pytest -q -p no:cacheprovider tests/test_offloaded_cache.py -k cuda
step train-ckpt 90 python -m benchmarks.train --device cuda --dtype bfloat16 --presets gpt2 \
    --batch-size 12 --compile --steps 20 --warmup-steps 5 --checkpointing on
step fit-card 90 python -m benchmarks.train --device cuda --dtype bfloat16 --presets gpt2 \
    --steps 2 --fit-memory 130 --checkpointing off,on
step fit-16gib 50 python -m benchmarks.train --device cuda --dtype bfloat16 --presets gpt2 \
    --steps 2 --fit-memory 16 --checkpointing off,on
echo "== done: $RESULTS"
