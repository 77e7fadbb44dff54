"""The engine on CUDA gives the CPU's tokens: python -m benchmarks.gpu_engine_check

A GPT-2-shaped model (random weights, float32) serves the same greedy requests through
the engine on the CPU and on the GPU; the tokens must be the same (float32 on both,
TF32 off), and the GPU's tokens/s is printed beside the CPU's. Run by benchmarks/gpu.sh.
"""

from __future__ import annotations

import random
import sys
import time

import torch

from roseinfer.engine import LLM
from roseinfer.request.sampling import SamplingParams
from rosetrainer.config import GPTConfig
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = False  # the CPU computes in true float32
    torch.manual_seed(0)
    config = GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=512)
    cpu_model = GPT(config).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(50000) for _ in range(rng.randrange(8, 64))] for _ in range(16)]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    tokenizer = Tokenizer("gpt2")
    runs = {}
    for device in ("cpu", "cuda"):
        model = cpu_model if device == "cpu" else GPT(config).to(device).eval()
        if device == "cuda":
            model.load_state_dict(cpu_model.state_dict())
        llm = LLM.from_model(model, tokenizer)
        llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        runs[device] = [out.token_ids for out in outputs]
        print(f"{device}: {len(prompts) * 32 / seconds:,.0f} tok/s")
    same = sum(a == b for a, b in zip(runs["cpu"], runs["cuda"], strict=True))
    print(f"engine on CUDA: {same}/{len(prompts)} requests with the CPU's tokens")
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
