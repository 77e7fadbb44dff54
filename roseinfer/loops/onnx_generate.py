"""Generation on an exported ONNX graph with onnxruntime: numpy and onnxruntime, no torch.

`rose-export-onnx` (roseinfer/cli/export_onnx.py) writes one graph (`model.onnx`) that
serves every step and a small JSON beside it (`rose_onnx.json`: the shapes, the I/O
names, the tokenizer). This module runs that graph the way Hugging Face's runtimes run theirs:

* the first step feeds the whole left-padded prompt with an *empty* past (past length 0);
* every later step feeds one token per row and the `present.*` the previous step returned
  as `past_key_values.*`, an `attention_mask` one column wider (1 real, 0 padding), and
  each row's next position (`position_ids`, counting real tokens only).

The graph computes the three cache invariants from these inputs: it concatenates past and
new keys/values, cuts the causal mask's bottom rows for the new tokens and applies the
padding columns, and embeds the positions it is given. The loop only keeps the tensors.

Each prompt is a `Sequence` (roseinfer/request/sequence.py) with the same `SamplingParams` and
stopping rules as the torch loop; sampling is the same filters written in numpy. Greedy
decoding gives the torch path's tokens; a seed gives reproducible samples, but numpy's
random stream is not torch's, so a seeded sample differs from the torch path's.
The graph knows `block_size` positions: a row stops ("length") when its context is full
(the torch loop instead re-prefills a shorter window, see roseinfer/loops/generate.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from roseinfer.request.rows import left_pad
from roseinfer.request.sampling_params import SamplingParams, params_per_prompt
from roseinfer.request.sequence import GenerationResult, Sequence
from roseinfer.request.token_step import TokenCallback, take_tokens
from rosetrainer.errors import RoseError, one_line

MODEL_FILE = "model.onnx"
META_FILE = "rose_onnx.json"


# The names Hugging Face's exporters (optimum) give a decoder with past key/values.
def input_names(n_layer: int) -> list[str]:
    past = [f"past_key_values.{i}.{kv}" for i in range(n_layer) for kv in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past]


def output_names(n_layer: int) -> list[str]:
    return ["logits"] + [f"present.{i}.{kv}" for i in range(n_layer) for kv in ("key", "value")]


@dataclass(frozen=True)
class OnnxMeta:
    """What the exporter wrote beside the graph (rose_onnx.json)."""

    n_layer: int
    n_head: int
    n_kv_head: int  # the heads of past_key_values (fewer than n_head: grouped queries)
    head_dim: int
    block_size: int
    vocab_size: int
    eot_id: int
    tokenizer_name: str
    opset: int
    source: str

    @classmethod
    def read(cls, path: Path) -> OnnxMeta:
        data = json.loads(path.read_text(encoding="utf-8"))
        data.setdefault("n_kv_head", data.get("n_head"))  # (written before grouped queries)
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})


class OnnxModel:
    """An exported decoder in an onnxruntime session: one call per generation step."""

    def __init__(
        self, directory: str | Path, threads: int | None = None, spin: bool = True
    ) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise RoseError("onnxruntime is not installed: pip install -e '.[onnx]'") from None

        directory = Path(directory)
        self.directory = directory
        for name in (MODEL_FILE, META_FILE):
            if not (directory / name).is_file():
                raise RoseError(
                    f"{directory / name} not found: export a model there first with "
                    f"`rose-export-onnx --out {directory}`"
                )
        try:
            self.meta = OnnxMeta.read(directory / META_FILE)
        except (ValueError, KeyError, TypeError) as err:
            raise RoseError(
                f"{directory / META_FILE} is not the exporter's JSON ({type(err).__name__}: "
                f"{err}): export the model again"
            ) from None
        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = threads
        if not spin:
            # onnxruntime's idle threads spin, waiting for the next run: fast for a loop of
            # runs, but they take the cores from anything else this process does (torch).
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self.session = ort.InferenceSession(
                str(directory / MODEL_FILE), options, providers=["CPUExecutionProvider"]
            )
        except Exception as err:  # onnxruntime raises its own exception types
            raise RoseError(
                f"onnxruntime cannot load {directory / MODEL_FILE} ({one_line(err, False)}): "
                "export it again"
            ) from None
        self.input_names = input_names(self.meta.n_layer)
        self.output_names = output_names(self.meta.n_layer)

    def empty_past(self, batch: int) -> list[np.ndarray]:
        """The first step's past: every layer's keys and values with 0 positions."""
        shape = (batch, self.meta.n_kv_head, 0, self.meta.head_dim)
        return [np.zeros(shape, dtype=np.float32) for _ in range(2 * self.meta.n_layer)]

    def __call__(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        past: list[np.ndarray],
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """One step: (B, T) new ids on top of `past` -> ((B, T, vocab) logits, present)."""
        inputs = [input_ids, attention_mask, position_ids, *past]
        feed = dict(zip(self.input_names, inputs, strict=True))
        logits, *present = self.session.run(self.output_names, feed)
        return logits, present


# ---------------------------------------------------------------------------
# Sampling in numpy: the filters of roseinfer/request/sampling.py, with the same tie rules
# ---------------------------------------------------------------------------


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep exactly the k largest logits, the rest -> -inf; ties go to the lower token id."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    order = np.argsort(-logits, kind="stable")  # descending; equal logits in id order
    kept = np.full_like(logits, -np.inf)
    kept[order[:k]] = logits[order[:k]]
    return kept


def top_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose probability reaches p (the most
    likely one always, and the one that carries the mass over p)."""
    if p >= 1.0:
        return logits
    order = np.argsort(-logits, kind="stable")
    probs = softmax(logits[order])
    mass_before = np.cumsum(probs) - probs
    drop = np.empty(logits.shape, dtype=bool)
    drop[order] = mass_before >= p
    return np.where(drop, -np.inf, logits)


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max())
    return shifted / shifted.sum()


def sample_next_token(
    logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None
) -> int:
    """(vocab,) logits -> one token id."""
    if params.greedy:
        return int(np.argmax(logits))
    # Shift the maximum to 0 first: a tiny temperature then gives -inf, never inf - inf = nan
    # (that overflow to -inf is the point, not a problem to warn about).
    logits = logits.astype(np.float32)
    with np.errstate(over="ignore"):
        logits = (logits - logits.max()) / np.float32(params.temperature)
    logits = top_p_filter(top_k_filter(logits, params.top_k), params.top_p)
    probs = softmax(logits.astype(np.float64))
    return int(rng.choice(probs.size, p=probs))


class OnnxSequence(Sequence):
    """A Sequence whose random stream is numpy's (this loop runs without torch)."""

    def new_generator(self) -> np.random.Generator | None:
        return None if self.params.greedy else np.random.default_rng(self.params.seed)


# ---------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------


def left_padded(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The first step's inputs: ids, attention mask (0 on padding) and positions per row."""
    padded, pads = left_pad(prompts)
    ids = np.array(padded, dtype=np.int64)
    attention_mask = (np.arange(ids.shape[1])[None, :] >= np.array(pads)[:, None]).astype(np.int64)
    # Positions count real tokens only: a row's first real token stands at 0.
    position_ids = np.maximum(attention_mask.cumsum(-1) - 1, 0)
    return ids, attention_mask, position_ids


def generate_batch(
    model: OnnxModel,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    *,
    eot_id: int | None = None,
    decode: Callable[[list[int]], str] | None = None,
    on_token: TokenCallback | None = None,
    keep_logits: bool = False,
) -> list[GenerationResult]:
    """Generate for several prompts as one left-padded batch; one result per prompt.

    The same arguments and results as roseinfer.loops.generate.generate_batch (step logits,
    with keep_logits, are numpy arrays).
    """
    seqs = _sequences(model, prompts, params, eot_id, decode)
    block_size = model.meta.block_size
    ids, attention_mask, position_ids = left_padded([seq.prompt_ids for seq in seqs])
    past = model.empty_past(len(seqs))
    step_logits: list[list[np.ndarray]] = [[] for _ in seqs]
    started = time.perf_counter()
    while True:
        logits, past = model(ids, attention_mask, position_ids, past)
        last = logits[:, -1, :]
        tokens = [
            sample_next_token(last[row], seq.params, seq.generator) for row, seq in enumerate(seqs)
        ]
        # A row stops ("length") when its context is full: no position left for its token.
        for row in take_tokens(seqs, tokens, on_token=on_token, max_len=block_size):
            if keep_logits:
                step_logits[row].append(last[row].copy())
        if all(seq.is_finished for seq in seqs):
            break
        # The next step: each row's new token, one more real column, the next position
        # (rows that have stopped still ride along; their outputs are never read).
        ids = np.array(tokens, dtype=np.int64)[:, None]
        attention_mask = np.concatenate([attention_mask, np.ones_like(ids)], axis=1)
        position_ids = np.minimum(position_ids[:, -1:] + 1, block_size - 1)
    return [
        seq.result(started, step_logits[row] if keep_logits else None)
        for row, seq in enumerate(seqs)
    ]


def _sequences(
    model: OnnxModel,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    eot_id: int | None,
    decode: Callable[[list[int]], str] | None,
) -> list[OnnxSequence]:
    """One checked OnnxSequence per prompt."""
    meta = model.meta
    params = params_per_prompt(prompts, params, meta.block_size)
    for prompt in prompts:
        if min(prompt) < 0 or max(prompt) >= meta.vocab_size:
            raise RoseError(
                f"a prompt has a token id outside the vocabulary [0, {meta.vocab_size})"
            )
    return [
        OnnxSequence(list(prompt), p, eos_id=eot_id, decode=decode)
        for prompt, p in zip(prompts, params, strict=True)
    ]
