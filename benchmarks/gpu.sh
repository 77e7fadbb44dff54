#!/usr/bin/env bash
# Every GPU measurement in one call, for the short, occasional GPU time rose gets:
#   OUT=/tmp/rose-gpu bash benchmarks/gpu.sh
# Needs, beside the repository: a copy of nanoGPT's repository in .peers/nanoGPT (train.py,
# model.py, configurator.py, unchanged) and the GPT-2 BPE files in .peers/tiktoken_cache.
# Each step writes its output to $OUT as it goes, and has a time limit of its own, so a
# run cut short still returns what it measured. Steps in order of what they answer.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/rose-gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/rose-inductor
export TIKTOKEN_CACHE_DIR="$PWD/.peers/tiktoken_cache"

step() {  # step NAME SECONDS COMMAND...: run it, its output to the screen and $OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date +%T), at most ${limit}s): $*"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    echo "== $name: exit ${PIPESTATUS[0]}"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  lscpu | grep -m1 'Model name'; } | tee "$OUT/machine.txt"

# Training: rose beside nanoGPT's train.py, GPT-2 124M, 12 x 1024, bfloat16, compiled.
step train 240 python -m benchmarks.train --device cuda --dtype bfloat16 --presets gpt2 \
    --batch-size 12 --compile --steps 20 --warmup-steps 5 --checkpointing off \
    --nanogpt .peers/nanoGPT --profile "$OUT/profile.txt"
# rose with nanoGPT's vocabulary padded to 50,304 (a multiple of 64).
step train-padded 90 python -m benchmarks.train --device cuda --dtype bfloat16 --presets gpt2 \
    --batch-size 12 --compile --steps 20 --warmup-steps 5 --checkpointing off --vocab-size 50304
# The offloaded KV cache against the dynamic and static caches at a 1024-token context.
step offload 90 python -m benchmarks.offload --device cuda --json "$OUT/offload.json"
# The engine on CUDA: the CPU's tokens.
step engine 60 python -m benchmarks.gpu_engine_check
# The tests that need CUDA (the offloaded cache's copy stream).
step cuda-tests 60 python -m pytest -q -p no:cacheprovider tests/test_offloaded_cache.py -k cuda
# The same training step with activation checkpointing on.
step train-ckpt 90 python -m benchmarks.train --device cuda --dtype bfloat16 --presets gpt2 \
    --batch-size 12 --compile --steps 20 --warmup-steps 5 --checkpointing on
# The largest batch (up to 256) on the whole card, and within 16 GiB, checkpointing off and on (eager).
step fit-card 90 python -m benchmarks.train --device cuda --dtype bfloat16 --presets gpt2 \
    --steps 2 --fit-memory 130 --checkpointing off,on
step fit-16gib 50 python -m benchmarks.train --device cuda --dtype bfloat16 --presets gpt2 \
    --steps 2 --fit-memory 16 --checkpointing off,on
