"""One pipeline stage: its share of the GPT's layers, built from the model's own modules.

A model split into N stages runs as N processes. Stage 0 holds the token and position
embeddings and the first layers, the last stage the last layers, the final LayerNorm
and the output head, and each stage between them a run of layers. A stage is not a
copy of the model: `PipelineStage` takes its blocks, embeddings and head out of a
`rosetrainer.model.GPT`, built on PyTorch's meta device (shapes, no memory), and then
fills in only those weights from the checkpoint.

Inside a stage its blocks are numbered from 0 again, and so is its cache: a stage
holding global layers 4..7 keeps four layers of keys and values, and block 4 writes
slot 0. `cache_slot` is the one place that says so; asking the stage's cache for
slot 4 (the global number) is the classic pipeline bug, an index out of range.

GPT-2 ties its output head to the token embedding: the same matrix reads tokens in
(stage 0) and scores them out (the last stage). Split across processes the two ends
each load their own copy of it.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from rosetrainer import model as gpt
from rosetrainer.checkpoint import load_checkpoint, strip_wrapper_prefixes
from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError
from rosetrainer.hf import load_hf
from rosetrainer.model import GPT, KVCache

BLOCK_NAME = re.compile(r"transformer\.h\.(\d+)\.")


def even_runs(total: int, parts: int) -> list[range]:
    """0..total cut into `parts` consecutive runs, as even as they come (the first runs
    take one more when `total` does not divide evenly)."""
    per_part, extra = divmod(total, parts)
    runs, start = [], 0
    for part in range(parts):
        stop = start + per_part + (1 if part < extra else 0)
        runs.append(range(start, stop))
        start = stop
    return runs


def stage_layers(n_layer: int, n_stages: int) -> list[range]:
    """The global layer numbers of each stage."""
    if not isinstance(n_stages, int) or isinstance(n_stages, bool) or n_stages < 1:
        raise RoseError(f"--pipeline-parallel-size must be an integer >= 1, got {n_stages!r}")
    if n_stages > n_layer:
        raise RoseError(
            f"--pipeline-parallel-size {n_stages} is more stages than the model's {n_layer} "
            f"layers (every stage needs at least one): use at most {n_layer}"
        )
    return even_runs(n_layer, n_stages)


def cache_slot(layers: range, local: int) -> int:
    """Which layer of the stage's cache the stage's `local`-th block uses: its local number.

    The cache holds only this stage's layers, numbered from 0; `layers[local]`, the
    block's number in the whole model, points past its end on every stage but the first.
    """
    return local


class PipelineStage(nn.Module):
    """The modules of one stage, taken from a GPT: embeddings (first stage), a run of
    blocks, final LayerNorm and head (last stage).

    Parameter names are the GPT's with the blocks renumbered from 0 (`checkpoint_name`
    maps them back), so a checkpoint's tensors load by name.
    """

    def __init__(self, model: GPT, stage: int, n_stages: int) -> None:
        super().__init__()
        self.config: GPTConfig = model.config
        self.stage, self.n_stages = stage, n_stages
        self.layers = stage_layers(self.config.n_layer, n_stages)[stage]  # global numbers
        parts: dict[str, nn.Module] = {
            "h": nn.ModuleList(model.transformer.h[self.layers.start : self.layers.stop])
        }
        if self.is_first:
            for name in ("wte", "wpe", "drop"):
                if name in model.transformer:  # (a rotary model has no wpe)
                    parts[name] = model.transformer[name]
        if self.is_last:
            parts["ln_f"] = model.transformer.ln_f
        self.transformer = nn.ModuleDict(parts)
        self.lm_head = model.lm_head if self.is_last else None

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.n_stages - 1

    @property
    def device(self) -> torch.device:
        return self.transformer.h[0].attn.c_attn.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.h[0].attn.c_attn.weight.dtype

    def checkpoint_name(self, name: str) -> str:
        """This stage's parameter name -> the whole model's ("transformer.h.0." of the stage
        holding layers 4..7 is "transformer.h.4.")."""
        return BLOCK_NAME.sub(lambda m: f"transformer.h.{self.layers[int(m[1])]}.", name, count=1)

    def forward(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run this stage's share of one model call on top of `cache`.

        x: token ids (B, T) at the first stage, hidden states (B, T, n_embd) after it.
        Returns hidden states (B, T, n_embd) for the next stage, or at the last stage the
        logits of each row's last token (B, vocab).
        """
        batch, q_len = x.shape[:2]
        # Every stage's cache answers for the same positions: it has seen the same steps.
        pos, attn_mask = cache.prepare(batch, q_len, x.device)
        parts = self.transformer
        rope = gpt.rope_for(self.config, pos)
        if self.is_first:
            x = gpt.embed(parts, x, pos)
        for local, block in enumerate(parts.h):
            x = block(x, attn_mask, cache, cache_slot(self.layers, local), rope)
        if self.is_last:
            x = gpt.vocabulary_logits(self.lm_head, parts.ln_f(x)[:, -1, :], self.config.vocab_size)
        return x

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


class NoRandomFill(TorchFunctionMode):
    """Inside it, `normal_` fills nothing: a GPT built on the meta device skips drawing its
    random init. (Drawing on a meta tensor does no work, but its first use imports
    torch._dynamo: a second or more at every stage process's start. The weights are
    loaded right after, so the init would be thrown away anyway.)"""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (nn.init.normal_, torch.Tensor.normal_):
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def load_stage(
    source: str | Path,
    stage: int,
    n_stages: int,
    *,
    hf: bool = False,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> PipelineStage:
    """Stage `stage` of `n_stages`, with its weights only, in eval mode.

    A rose checkpoint is memory-mapped, and only this stage's tensors are read from it.
    A Hugging Face directory is loaded whole (its tensors are renamed and transposed
    together), and everything outside the stage is dropped at once.
    """
    if hf:
        stage_module = PipelineStage(load_hf(str(source)), stage, n_stages)
        return stage_module.to(device=device, dtype=dtype).eval()
    ckpt = load_checkpoint(source, mmap=True)
    config = GPTConfig.from_dict(ckpt["model_config"])
    stage_layers(config.n_layer, n_stages)  # a clear error before anything is built
    if config.sliding_window is not None:  # (its caches are static or concat: no window)
        raise RoseError("a split model keeps every key; a sliding-window model needs a "
                        "rolling cache: run it in one process (cli_generate --cache rolling)")  # fmt: skip
    with torch.device("meta"), NoRandomFill():  # shapes only: the stage's tensors come below
        model = GPT(config)
    stage_module = PipelineStage(model, stage, n_stages).to_empty(device=device)
    weights = strip_wrapper_prefixes(ckpt["model"])
    share = {}
    for name in stage_module.state_dict():
        source_name = stage_module.checkpoint_name(name)
        if source_name not in weights:
            raise RoseError(f"checkpoint {source} lacks {source_name}: it does not fit its config")
        share[name] = weights[source_name]
    stage_module.load_state_dict(share)  # copies this stage's tensors out of the mapped file
    return stage_module.to(dtype=dtype).eval()
