"""The serving engine's flags, defined once for both front doors (rose-serve, cli_generate).

The names are vLLM's where vLLM has one (`--max-num-seqs`, `--max-num-batched-tokens`,
`--no-prefix-caching`, `--kv-cache-dtype`, `--num-kv-blocks`'s pool size); rose's own are
`--kv-block-size` (tokens per KV block: `--block-size` would read as the model's context,
which is `block_size` everywhere in rose), `--kv-cache-memory` and the quantized pool's
`--kv-cache-window` / `--kv-cache-group-size`. The defaults are `EngineConfig`'s.
"""

from __future__ import annotations

import argparse

from roseinfer.cache.quantized import KV_CACHE_DTYPES
from roseinfer.engine.config import EngineConfig

DEFAULTS = EngineConfig()


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
        "--decode-slots-memory",
        help="bytes the decode slots may take, e.g. 512MiB: a second copy of the decoding "
        "requests' keys and values, read without a gather; past it a step gathers from the "
        "pool (default: as much as the KV pool, at least 64MiB)",
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
        default=DEFAULTS.kv_cache_window,
        help="with int8/int4: the latest tokens kept exact, in the model's dtype; older ones "
        "are quantized a group at a time (0: none but a group still filling; the engine "
        f"rounds the window out to whole KV blocks; default: {DEFAULTS.kv_cache_window})",
    )
    engine.add_argument(
        "--kv-cache-group-size",
        type=int,
        default=DEFAULTS.kv_cache_group_size,
        help="with int8/int4: numbers sharing one scale and zero point; must divide the "
        "head size (the engine groups keys by KV block; "
        f"default: {DEFAULTS.kv_cache_group_size})",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The flags as an EngineConfig (which checks them: a bad value is one clear line)."""
    return EngineConfig(
        kv_block_size=args.kv_block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        pack_weights=not args.no_pack_weights,
        decode_slots_memory=args.decode_slots_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_window=args.kv_cache_window,
        kv_cache_group_size=args.kv_cache_group_size,
    )
