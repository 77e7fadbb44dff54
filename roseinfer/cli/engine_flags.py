"""The serving engine's flags, defined once for both front doors (rose-serve, cli_generate).

The names are vLLM's where vLLM has one (`--max-num-seqs`, `--max-num-batched-tokens`,
`--no-prefix-caching`, `--kv-cache-dtype`, `--num-kv-blocks`'s pool size); rose's own are
`--kv-block-size` (tokens per KV block: `--block-size` would read as the model's context,
which is `block_size` everywhere in rose), `--kv-cache-memory` and the quantized pool's
`--kv-cache-window` / `--kv-cache-group-size`. The defaults are `EngineConfig`'s.

Speculative decoding's flags follow vLLM's older ones (`--speculative-model`,
`--num-speculative-tokens`, and `--speculative-method` for the drafts without a second
model); `engine_from_flags` builds the engine with its drafter.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from contextlib import contextmanager

from roseinfer.cache.quantized import KV_CACHE_DTYPES
from roseinfer.engine.config import ATTENTIONS, EngineConfig
from roseinfer.engine.llm_engine import LLMEngine, speculative_engine
from roseinfer.speculative.drafters import SpeculativeConfig
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer

DEFAULTS = EngineConfig()
# EngineConfig's fields that a flag sets: its errors name the field (the Python API's
# word), a command's errors the flag the user typed.
FLAG_FIELDS = re.compile(
    r"\b(kv_block_size|num_kv_blocks|kv_cache_memory|max_num_seqs|max_num_batched_tokens"
    r"|kv_cache_dtype|kv_cache_window|kv_cache_group_size)\b"
)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The engine's sizes and its pool's storage, as one group of `parser`'s help."""
    engine = parser.add_argument_group(
        "engine", "the serving engine: a paged KV pool, continuous batching, prefix caching"
    )
    engine.add_argument(
        "--kv-cache-memory",
        help="the KV pool's size in bytes, e.g. 2GiB or 512MiB (default: room for every "
        "running request's whole context, at most 2GiB)",
    )
    engine.add_argument(
        "--num-kv-blocks",
        type=int,
        help="the KV pool's size in blocks of --kv-block-size tokens (instead of "
        "--kv-cache-memory)",
    )
    engine.add_argument(
        "--kv-block-size",
        type=int,
        default=DEFAULTS.kv_block_size,
        help=f"tokens per KV block (default: {DEFAULTS.kv_block_size})",
    )
    engine.add_argument(
        "--max-num-seqs",
        type=int,
        default=DEFAULTS.max_num_seqs,
        help=f"requests running at once, at most (default: {DEFAULTS.max_num_seqs})",
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=DEFAULTS.max_num_batched_tokens,
        help="tokens per model step, decode tokens plus prompt chunks, at most "
        f"(default: {DEFAULTS.max_num_batched_tokens})",
    )
    engine.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not reuse the KV blocks of prompts' shared prefixes",
    )
    engine.add_argument(
        "--attention",
        choices=ATTENTIONS,
        default=DEFAULTS.attention,
        help="how attention reads keys and values from the KV pool: 'kernel', decoding "
        "requests in place by a small C kernel built at first use (on a CPU; elsewhere, or "
        "without a C compiler, it gathers); 'flex', every request in place through compiled "
        "FlexAttention; 'gather', each decoding request's blocks gathered every step; "
        f"'auto', flex on CUDA, else kernel (the same tokens; default: {DEFAULTS.attention})",
    )
    engine.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly: no CUDA graphs for decode steps (with flex attention "
        "on CUDA, decode steps replay graphs captured at start-up, one per batch-size bucket)",
    )
    engine.add_argument(
        "--num-threads",
        type=int,
        help="CPU threads for PyTorch, fixed (default: auto, one per core while the cores "
        "are free, fewer while other programs keep them busy; OMP_NUM_THREADS fixes it too)",
    )
    engine.add_argument(
        "--no-pack-weights",
        action="store_true",
        help="on a CPU, run the linear layers on the weights as stored instead of a copy "
        "packed once for oneDNN (slower steps, one copy of the weights less; the engine and "
        "the cached single-prompt paths pack by default)",
    )
    engine.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=DEFAULTS.kv_cache_dtype,
        help="how the KV cache stores keys and values: auto (the model's dtype, default), "
        "int8 or int4 (quantized in groups, keys per channel and values per token, the "
        "latest tokens exact; see --kv-cache-window)",
    )
    engine.add_argument(
        "--kv-cache-window",
        type=int,
        default=None,  # (None: not given; a window without int8/int4 is refused)
        help="with int8/int4: the latest tokens kept exact, in the model's dtype; older ones "
        "are quantized a group at a time (0: none but a group still filling; the engine "
        f"rounds the window out to whole KV blocks; default: {DEFAULTS.kv_cache_window})",
    )
    engine.add_argument(
        "--kv-cache-group-size",
        type=int,
        default=None,  # (None: not given; a group size without int8/int4 is refused)
        help="with int8/int4: numbers sharing one scale and zero point; must divide the "
        "head size (the engine groups keys by KV block; "
        f"default: {DEFAULTS.kv_cache_group_size})",
    )

    add_speculative_flags(parser)


def add_speculative_flags(parser: argparse.ArgumentParser) -> None:
    spec = parser.add_argument_group(
        "speculative decoding",
        "a drafter proposes the next tokens, the model verifies them in one step; greedy "
        "requests only (their output is unchanged), sampled ones decode one token a step",
    )
    which = spec.add_mutually_exclusive_group()
    which.add_argument(
        "--speculative-model",
        metavar="PATH",
        help="a smaller draft model sharing the model's tokenizer: a rose .pt, a run "
        "directory or a Hugging Face GPT-2 directory",
    )
    which.add_argument(
        "--speculative-method",
        metavar="ngram|self:N",
        help="drafts without a second model: ngram (prompt lookup: the tokens that followed "
        "the last n tokens earlier in the prompt and output) or self:N (the model's own "
        "first N layers through its LM head)",
    )
    spec.add_argument(
        "--num-speculative-tokens",
        type=int,
        metavar="K",
        help="tokens drafted per step (needed with --speculative-model or --speculative-method)",
    )
    spec.add_argument(
        "--ngram-min", type=int, default=1, help="prompt lookup's shortest n-gram (default: 1)"
    )
    spec.add_argument(
        "--ngram-max", type=int, default=4, help="prompt lookup's longest n-gram (default: 4)"
    )


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The speculative flags, checked (None when none is given)."""
    return SpeculativeConfig.from_flags(
        args.speculative_model,
        args.speculative_method,
        args.num_speculative_tokens,
        args.ngram_min,
        args.ngram_max,
    )


def engine_from_flags(model: GPT, tokenizer: Tokenizer, args: argparse.Namespace) -> LLMEngine:
    """The engine the flags describe, with its drafter when they ask for one (a draft
    model is loaded and checked against `model` here)."""
    with named_by_flag():
        return speculative_engine(model, tokenizer, engine_config(args), speculative_config(args))


@contextmanager
def named_by_flag() -> Iterator[None]:
    """An engine setting's error, naming the flag instead of EngineConfig's field."""
    try:
        yield
    except RoseError as err:
        flag = FLAG_FIELDS.sub(lambda m: "--" + m.group(1).replace("_", "-"), str(err))
        raise RoseError(flag) from None


def kv_cache_window(args: argparse.Namespace) -> int:
    """--kv-cache-window, or the default where it was not given."""
    check_quantization_flags(args)
    window = args.kv_cache_window
    return DEFAULTS.kv_cache_window if window is None else window


def kv_cache_group_size(args: argparse.Namespace) -> int:
    """--kv-cache-group-size, or the default where it was not given."""
    check_quantization_flags(args)
    size = args.kv_cache_group_size
    return DEFAULTS.kv_cache_group_size if size is None else size


def check_quantization_flags(args: argparse.Namespace) -> None:
    """--kv-cache-window and --kv-cache-group-size shape a quantized cache only: given
    without --kv-cache-dtype int8 or int4 they would be silently dropped, so say so."""
    if args.kv_cache_dtype != "auto":
        return
    for flag, value in (
        ("--kv-cache-window", args.kv_cache_window),
        ("--kv-cache-group-size", args.kv_cache_group_size),
    ):
        if value is not None:
            raise RoseError(
                f"{flag} shapes a quantized KV cache: add --kv-cache-dtype int8 or int4, "
                f"or drop {flag}"
            )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The flags as an EngineConfig (which checks them: a bad value is one clear line)."""
    with named_by_flag():
        return EngineConfig(
            kv_block_size=args.kv_block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory=args.kv_cache_memory,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
            pack_weights=not args.no_pack_weights,
            attention=args.attention,
            enforce_eager=args.enforce_eager,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_cache_window=kv_cache_window(args),
            kv_cache_group_size=kv_cache_group_size(args),
        )
