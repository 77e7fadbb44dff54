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
step train 330 python -m rosetrainer.bench --device cuda --dtype bfloat16 --presets gpt2 \
    --batch-size 12 --compile --steps 20 --warmup-steps 5 --checkpointing off,on \
    --nanogpt .peers/nanoGPT --profile "$OUT/profile.txt"
# The largest batch on the whole card, and within 16 GiB, checkpointing off and on (eager).
step fit-card 90 python -m rosetrainer.bench --device cuda --dtype bfloat16 --presets gpt2 \
    --steps 2 --fit-memory 130
step fit-16gib 90 python -m rosetrainer.bench --device cuda --dtype bfloat16 --presets gpt2 \
    --steps 2 --fit-memory 16
# The offloaded KV cache against the dynamic and static caches at a 1024-token context.
step offload 120 python -m roseinfer.bench.offload --device cuda --json "$OUT/offload.json"
# The engine on CUDA: the CPU's tokens.
step engine 90 python benchmarks/gpu_engine_check.py
