"""The model, prompt and comparisons the chapters share.

The chapters check every cached path against the uncached greedy output, the
oracle. An oracle is only as strong as the model under it: if greedy decoding
repeats one token, or a step is a near-tie, a broken cache can produce the same
text, or a correct one a different token. So `demo_model()` takes a model that
makes a strong oracle: varied greedy tokens, each winning by a clear margin.

* The newest trained checkpoint under checkpoints/, if it is strong (a well
  trained one is, and its text reads like its training data); a young one, whose
  greedy text is a single repeated token, is passed over, saying why.
* Otherwise a small seeded random GPT, re-initialised by `wide_random_init` so
  that its greedy output is varied, depends on where each token stands, and every
  step's winner beats the runner-up clearly. (With the usual init, std 0.02, the
  logits are nearly uniform and greedy decoding walks through near-ties.)

ROSE_CHAPTER_MODEL picks another: "random" always takes the random model (the tests
do, so they never depend on what was trained on a machine), and a path to a .pt
file takes that checkpoint, strong or not.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch import nn

from roseinfer.cache.dense import ConcatKVCache
from roseinfer.loops.generate import GenerationResult, generate
from roseinfer.request.sampling import SamplingParams
from rosetrainer.checkpoint import find_latest_checkpoint, load_model
from rosetrainer.config import GPTConfig
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer

# Small enough for a CPU in seconds; GPT-2's vocabulary, so the gpt2 tokenizer decodes it.
RANDOM_MODEL_CONFIG = GPTConfig(vocab_size=50257, block_size=64, n_layer=2, n_head=4, n_embd=64)
# Chapter 18's model: rotary positions, a window of 8 and 2 sinks. A 512-token vocabulary
# keeps the uncached oracle (the whole sequence, every step, far past the context) quick.
WINDOWED_MODEL_CONFIG = GPTConfig(
    vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=32,
    position_embedding="rotary", sliding_window=8, attention_sinks=2,
)  # fmt: skip
PROMPT = "ROMEO:\nWhat light is that"
NEW_TOKENS = 32
# A strong oracle: at least this share of distinct greedy tokens, and every step's top
# logit ahead of the second by at least this much: tens of float32 logit tolerances at the
# chapter models' scale (rosetrainer/numerics.py), so no rounding can swap the two.
MIN_DISTINCT_FRACTION = 0.4
MIN_MARGIN = 1e-2


def wide_random_init(model: GPT, seed: int) -> GPT:
    """Re-initialise `model` in place as a strong oracle for cache tests; return it in eval mode.

    * token and position embeddings with std 1.0, so a token's position moves the
      logits as much as its identity does (wrong positions cannot go unnoticed);
    * every matrix with std 1/sqrt(fan_in), so attention and the MLPs, not the last
      token's own embedding, decide what comes next;
    * an output matrix of its own: through the tied one a random model keeps
      predicting the token it was just given. It is scaled so logits have std ~4,
      which puts clear gaps between the top candidates.
    """
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    model.lm_head.weight = nn.Parameter(torch.empty(config.padded_vocab_size, config.n_embd))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(("transformer.wte.", "transformer.wpe.")):
                param.normal_(0.0, 1.0, generator=generator)
            elif param.dim() == 2:
                param.normal_(0.0, 1.0 / math.sqrt(param.size(1)), generator=generator)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1, generator=generator)
            # LayerNorm weights keep their 1.0
        model.lm_head.weight.mul_(4.0)
    return model.eval()


def chapter_root() -> Path:
    """The repository folder the chapters work from: the current one, or its parent when
    the current one is notebooks/ (where Jupyter starts a notebook's kernel)."""
    cwd = Path.cwd()
    return cwd.parent if cwd.name == "notebooks" else cwd


def demo_model(seed: int = 0) -> tuple[GPT, Tokenizer, str]:
    """(model in eval mode, its tokenizer, one line saying which model it is and why)."""
    choice = os.environ.get("ROSE_CHAPTER_MODEL", "")
    passed_over = ""
    if choice != "random":
        root = chapter_root()
        path = Path(choice) if choice else find_latest_checkpoint(root / "checkpoints")
        if path is not None:
            model, ckpt = load_model(path)
            model.eval()
            tokenizer = Tokenizer(ckpt.get("tokenizer_name", "gpt2"))
            shown = os.path.relpath(path, root)  # no machine-specific path in a notebook
            weakness = None if choice else oracle_weakness(model, tokenizer)
            if weakness is None:
                return (
                    model,
                    tokenizer,
                    f"trained checkpoint {shown} (step {ckpt.get('step', '?')})",
                )
            passed_over = f"; {shown} was passed over: {weakness}"
    model = wide_random_init(GPT(RANDOM_MODEL_CONFIG), seed)
    description = (
        f"random seeded model (seed {seed}): the text is gibberish, the checks are not{passed_over}"
    )
    return model, Tokenizer("gpt2"), description


def oracle_weakness(model: GPT, tokenizer: Tokenizer) -> str | None:
    """Why greedy decoding of PROMPT on `model` makes a weak oracle; None if it is strong."""
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    result = generate(model, tokenizer.encode(PROMPT), greedy, use_cache=False, keep_logits=True)
    distinct = len(set(result.token_ids)) / len(result.token_ids)
    if distinct < MIN_DISTINCT_FRACTION:
        return f"its greedy text repeats itself ({distinct:.0%} distinct tokens)"
    margins = top2_margins(result.step_logits)
    if min(margins) < MIN_MARGIN:
        step = margins.index(min(margins))
        return f"step {step} is a near-tie (top-2 logits {min(margins):.1e} apart)"
    return None


def top2_margins(step_logits: list[torch.Tensor]) -> list[float]:
    """How far the best logit is ahead of the second best, at each step."""
    return [
        float(top2[0] - top2[1]) for top2 in (torch.topk(s.float(), 2).values for s in step_logits)
    ]


# ---------------------------------------------------------------------------
# Comparing a run with the oracle (chapter 01's uncached greedy output)
# ---------------------------------------------------------------------------


def first_divergence(expected: list[int], got: list[int]) -> int | None:
    """The first step where two token sequences differ (a length difference counts), or None."""
    for step, (a, b) in enumerate(zip(expected, got, strict=False)):
        if a != b:
            return step
    return None if len(expected) == len(got) else min(len(expected), len(got))


def logit_gaps(expected: GenerationResult, got: GenerationResult) -> list[float]:
    """The largest absolute logit difference at each step both runs took (keep_logits=True)."""
    pairs = zip(expected.step_logits, got.step_logits, strict=False)
    return [float((a - b).abs().max()) for a, b in pairs]


def side_by_side(tokenizer: Tokenizer, runs: dict[str, list[int]], step: int = 0) -> str:
    """The runs' texts from `step` on, one labelled line each, to read them against each other."""
    width = max(len(label) for label in runs)
    lines = [f"{label:>{width}} | {tokenizer.decode(ids[step:])!r}" for label, ids in runs.items()]
    return "\n".join(lines)


def decode_attention(model: GPT, prompt_ids: list[int], mask_row: torch.Tensor) -> torch.Tensor:
    """Layer 0's attention weights (n_head, kv_len) of the first decode query under `mask_row`.

    The prompt is prefilled into a cache, its greedy next token is the decode query (at its
    true position), and `mask_row` ((1, kv_len) bool) says which keys that query may see.
    """
    cache = ConcatKVCache()
    block, head_dim = model.transformer.h[0], model.config.head_dim
    with torch.inference_mode():
        token = model(torch.tensor([prompt_ids]), cache=cache).logits[:, -1:].argmax(-1)
        position = torch.tensor([len(prompt_ids)])
        x = block.ln_1(model.transformer.wte(token) + model.transformer.wpe(position))
        q, k, _ = block.attn.c_attn(x).split(model.config.n_embd, dim=2)
        q, k = (t.view(1, 1, -1, head_dim).transpose(1, 2) for t in (q, k))
        keys = torch.cat([cache.past_kv[0][0], k], dim=2)
        scores = (q @ keys.transpose(-2, -1)) / math.sqrt(head_dim)
        return torch.softmax(scores.masked_fill(~mask_row, float("-inf")), dim=-1)[0, :, 0]
