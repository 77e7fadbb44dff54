"""python -m roseinfer.cli.export_hf (rose-export-hf): a rose model as a Hugging Face folder.

    rose-export-hf --checkpoint-path checkpoints/tiny --out hf/tiny

A GPT-2 becomes what Hugging Face's GPT-2 holds: config.json (GPT2LMHeadModel),
model.safetensors, generation_config.json and GPT-2's tokenizer files, built from
tiktoken's BPE (rosetrainer.hf.save_hf_gpt2). A Llama-shaped model (the tiny-llama preset
and its kind) becomes a LlamaForCausalLM, or a Qwen2ForCausalLM when it has biases on its
queries, keys and values (rosetrainer.hf.save_hf_llama), with the same tokenizer files.
`transformers`' Auto classes, vLLM (`vllm serve DIR`) and llama.cpp's convert_hf_to_gguf.py
read them, and so does rose (`--hf-model DIR`).

The model is loaded as generation loads it (roseinfer.loading), so a vocabulary padded
past the tokenizer's loses its padding rows and config.json's vocab_size is the
tokenizer's. The folder is written under a temporary name and renamed only once every
file is written and rose's own Hugging Face loader has read it back to the same
logits: a mistake or a crash leaves nothing behind, and an existing non-empty folder
is replaced only with --overwrite, never when it is, holds or lies inside the checkpoint
or run directory it is made from.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from roseinfer.loading import load_model_and_tokenizer, newest_checkpoint
from rosetrainer.errors import ArgumentParser, RoseError, run_cli
from rosetrainer.files import new_directory
from rosetrainer.hf import load_hf, save_hf
from rosetrainer.model import GPT

PROG = "roseinfer.cli.export_hf"
CHECK_TOKENS = 16  # the read-back check's input length (cut to the context window)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        description="Write a rose checkpoint as a Hugging Face GPT-2, Llama or Qwen2 folder "
        "(config.json, model.safetensors, tokenizer files) that transformers, vLLM and "
        "llama.cpp's converter read.",
    )
    p.add_argument(
        "--checkpoint-path",
        help="a rose .pt file or run directory (default: the newest under checkpoints/)",
    )
    p.add_argument("--out", required=True, help="the folder to write (created)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace --out if it exists and is not empty"
    )
    return p


@torch.no_grad()
def check_read_back(model: GPT, folder: Path) -> None:
    """rose's Hugging Face loader gives the exported model the very same logits."""
    config = model.config
    ids = (torch.arange(min(CHECK_TOKENS, config.block_size)) * 7919 % config.vocab_size)[None]
    again = load_hf(str(folder)).eval()
    if not torch.equal(model(ids).logits, again(ids).logits):
        raise RoseError("the exported folder reads back to other logits than the model's")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    given = Path(args.checkpoint_path) if args.checkpoint_path else newest_checkpoint()
    with new_directory(out, args.overwrite, source=given) as folder:
        model, tokenizer, source = load_model_and_tokenizer(str(given))
        names = save_hf(model, tokenizer.encoding, folder)
        check_read_back(model, folder)
    params = model.num_params(non_embedding=False)
    print(f"[{PROG}] model: {source} ({params:,} params, tokenizer {tokenizer.name})")
    print(f"[{PROG}] wrote {out}: {', '.join(names)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: run(build_parser().parse_args(argv)), PROG)


if __name__ == "__main__":
    sys.exit(main())
