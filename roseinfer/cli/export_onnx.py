"""rose-export-onnx (python -m roseinfer.cli.export_onnx): export a model to one ONNX graph.

    rose-export-onnx --checkpoint-path checkpoints/tiny --out onnx/tiny
    rose-export-onnx --hf-model path/to/gpt2 --out onnx/gpt2

Loads the model, exports it with its past key/values (roseinfer/loops/export_onnx.py),
writes the JSON the onnxruntime loop reads beside it, and checks the graph in
onnxruntime against PyTorch: a graph that fails the check, or whose writing failed (a
full disk, Ctrl-C), is removed, so no runtime picks it up. Bad input is one line and
exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from roseinfer.loading import load_model_and_tokenizer
from roseinfer.loops.export_onnx import (
    CHECK_CASES,
    DEFAULT_OPSET,
    check_against_torch,
    export,
    write_meta,
)
from roseinfer.loops.onnx_generate import META_FILE, MODEL_FILE, OnnxModel
from rosetrainer.errors import ArgumentParser, RoseError, os_error_line, run_cli
from rosetrainer.files import ensure_writable_dir

PROG = "rose-export-onnx"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        description="Export a rose checkpoint or a Hugging Face GPT-2 to one ONNX graph with "
        "past key/values (every step, any batch and length), check it in onnxruntime "
        "against PyTorch, and write it with a small JSON beside it.",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--checkpoint-path",
        help="a rose .pt file or run directory (default: the newest under checkpoints/)",
    )
    source.add_argument("--hf-model", help="a local Hugging Face GPT-2 directory")
    p.add_argument("--out", required=True, help="directory to write model.onnx and rose_onnx.json")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"default: {DEFAULT_OPSET}")
    p.add_argument(
        "--tokenizer-name", help="tiktoken encoding (default: the checkpoint's, else gpt2)"
    )
    return p


def checked_opset(opset: int) -> int:
    import onnx

    newest = onnx.defs.onnx_opset_version()
    if not DEFAULT_OPSET <= opset <= newest:
        raise RoseError(
            f"--opset {opset} is not supported: the exporter writes opsets "
            f"{DEFAULT_OPSET}..{newest} (onnx {onnx.__version__})"
        )
    return opset


def status(what: str, value: object) -> None:
    print(f"[{PROG}] {what}: {value}", flush=True)


def run(args: argparse.Namespace) -> int:
    opset = checked_opset(args.opset)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise RoseError(f"--out {out} is a file: give a directory")
    ensure_writable_dir(out, "--out")  # before the slow part: /proc/x, a file's "child"
    model, tokenizer, source = load_model_and_tokenizer(
        args.checkpoint_path, args.hf_model, args.tokenizer_name
    )
    status("model", f"{source} ({model.num_params(non_embedding=False):,} params)")
    started = time.perf_counter()
    try:
        export(model, out / MODEL_FILE, opset)
        write_meta(model, out, tokenizer.eot_id, tokenizer.name, opset, source)
    except OSError as err:  # a full disk mid-write: no half graph is left for a runtime
        discard(out)
        raise RoseError(os_error_line(err, out / MODEL_FILE, "write")) from None
    except BaseException:  # Ctrl-C mid-write, likewise
        discard(out)
        raise
    status("exported", f"{out / MODEL_FILE} (opset {opset}, {time.perf_counter() - started:.1f} s)")
    try:
        onnx_model = OnnxModel(out)
    except RoseError:
        discard(out)
        if opset == DEFAULT_OPSET:
            raise
        import onnxruntime

        raise RoseError(
            f"onnxruntime {onnxruntime.__version__} cannot run the graph written at opset "
            f"{opset}: export with a lower --opset ({DEFAULT_OPSET} always works)"
        ) from None
    largest, tolerance = check_against_torch(model, onnx_model)
    cases = ", ".join(f"batch {b} prompt {n}" for b, _, n in CHECK_CASES)
    status(
        "check",
        f"onnxruntime vs PyTorch ({cases}, then decode): "
        f"max |logit diff| {largest:.2e} (tolerance {tolerance:.1e})",
    )
    if largest > tolerance:
        discard(out)
        raise RoseError(
            f"the exported graph's logits differ from PyTorch's by {largest:.2e} "
            f"(> {tolerance:.1e}): the export is wrong and was removed"
        )
    return 0


def discard(out: Path) -> None:
    """Remove a graph that failed its check or its writing, so no runtime picks it up."""
    for path in out.glob(f"{MODEL_FILE}*"):  # model.onnx and any external-data file
        path.unlink()
    (out / META_FILE).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: run(build_parser().parse_args(argv)), PROG)


if __name__ == "__main__":
    sys.exit(main())
