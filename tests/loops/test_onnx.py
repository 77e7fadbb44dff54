"""The ONNX export and its onnxruntime loop, against the oracle (fp32, CPU).

Three exports per run of this module: a seeded strong-oracle model (tests/models.py) in
this process, driven step by step by the onnxruntime loop from an empty past to a full
context; then, through the exporter's command line, a Hugging Face GPT-2 directory
(conftest's) and a tiny rose checkpoint (for `cli_generate --onnx`).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from models import (
    LLAMA_CHOICES,
    assert_clear_margins,
    assert_logits_close,
    assert_varied,
    make_test_model,
)

from roseinfer.cli import export_onnx as export_command
from roseinfer.cli import generate as cli_generate
from roseinfer.loops import export_onnx, onnx_generate
from roseinfer.loops.generate import generate
from roseinfer.loops.onnx_generate import OnnxModel
from roseinfer.request.sampling import SamplingParams, top_k_filter, top_p_filter
from rosetrainer.checkpoint import save_checkpoint
from rosetrainer.config import GPTConfig
from rosetrainer.hf import load_hf_gpt2
from rosetrainer.model import GPT

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]

TINY = GPTConfig(vocab_size=50257, block_size=32, n_layer=1, n_head=2, n_embd=32)


def export_cli(*args: str | Path) -> tuple[int, str]:
    """The exporter's command line, in this process: (exit code, stdout)."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = export_command.main([str(arg) for arg in args])
    return code, stdout.getvalue()


@pytest.fixture(scope="module")
def hf_export(hf_gpt2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("onnx_hf")
    code, stdout = export_cli("--hf-model", hf_gpt2_dir, "--out", out)
    assert code == 0
    assert_checked_itself(stdout)
    return out


def assert_checked_itself(stdout: str) -> None:
    """The exporter printed its own onnxruntime-vs-PyTorch difference, and it is small."""
    check = re.search(r"max \|logit diff\| (\S+) \(tolerance (\S+)\)$", stdout, re.M)
    assert check, stdout
    assert float(check.group(1)) <= float(check.group(2))


@pytest.fixture(scope="module")
def hf_model(hf_gpt2_dir: Path) -> GPT:
    return load_hf_gpt2(str(hf_gpt2_dir)).eval()


@pytest.fixture(scope="module")
def hf_onnx(hf_export: Path) -> OnnxModel:
    return OnnxModel(hf_export, threads=1)


@pytest.fixture(scope="module")
def strong_model() -> GPT:
    return make_test_model(seed=0, block_size=32, vocab_size=512)


def exported(model: GPT, out: Path) -> OnnxModel:
    """The model's graph (exported at 2 rows, 3 past and 4 new tokens), loaded."""
    export_onnx.export(model, out / onnx_generate.MODEL_FILE)
    export_onnx.write_meta(model, out, eot_id=511, tokenizer_name="gpt2", opset=18, source="test")
    return OnnxModel(out, threads=1)


@pytest.fixture(scope="module")
def onnx_model(strong_model: GPT, tmp_path_factory: pytest.TempPathFactory) -> OnnxModel:
    return exported(strong_model, tmp_path_factory.mktemp("onnx_strong"))


@pytest.fixture(scope="module")
def rotary_model() -> GPT:
    return make_test_model(seed=4, block_size=32, vocab_size=512, position_embedding="rotary")


class RecordingModel:
    """An OnnxModel that remembers the past length and new tokens of every call."""

    def __init__(self, model: OnnxModel) -> None:
        self.model, self.meta, self.calls = model, model.meta, []

    def empty_past(self, batch: int) -> list[np.ndarray]:
        return self.model.empty_past(batch)

    def __call__(self, ids, attention_mask, position_ids, past):  # noqa: ANN001, ANN204
        self.calls.append((past[0].shape[2], ids.shape[1]))
        return self.model(ids, attention_mask, position_ids, past)


def oracle(model: GPT, prompt: list[int]):  # noqa: ANN201
    """Uncached greedy run that fills the context exactly (the last token at block_size - 1)."""
    params = SamplingParams(max_tokens=model.config.block_size - len(prompt) + 1, ignore_eos=True)
    return generate(model, prompt, params, use_cache=False, keep_logits=True)


def assert_rows_match_oracle(results, expected) -> None:  # noqa: ANN001
    for row, (got, want) in enumerate(zip(results, expected, strict=True)):
        assert_clear_margins(want.step_logits)
        assert_varied(want.token_ids)
        assert got.token_ids == want.token_ids, f"row {row}"
        assert got.finish_reason == "length"  # the context is full
        assert len(got.step_logits) == len(want.step_logits)
        for step, (a, b) in enumerate(zip(got.step_logits, want.step_logits, strict=True)):
            assert_logits_close(torch.from_numpy(a), b, f"row {row} step {step}: ")


# -- the graph against the oracle --


def test_batch_of_one_from_an_empty_past_to_a_full_context(
    onnx_model: OnnxModel, strong_model: GPT
) -> None:
    block_size = strong_model.config.block_size
    prompt = [464]
    recording = RecordingModel(onnx_model)
    greedy = SamplingParams(max_tokens=block_size, ignore_eos=True)
    results = onnx_generate.generate_batch(recording, [prompt], greedy, keep_logits=True)
    # One prefill on an empty past, then one token per step on past 1, 2, ..., block_size - 1.
    assert recording.calls == [(0, 1)] + [(past, 1) for past in range(1, block_size)]
    assert_rows_match_oracle(results, [oracle(strong_model, prompt)])


@pytest.mark.parametrize("position_embedding", ["learned", "rotary", "llama"])
def test_left_padded_ragged_batch_of_three(
    position_embedding: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Rotary positions export too: the graph turns its keys at the position_ids given. A
    Llama-shaped model (four query heads over one key/value head) too: its past_key_values
    hold the key/value heads only."""
    if position_embedding == "learned":
        strong_model = request.getfixturevalue("strong_model")
        model = request.getfixturevalue("onnx_model")
    elif position_embedding == "rotary":
        strong_model = request.getfixturevalue("rotary_model")
        model = exported(strong_model, tmp_path)
    else:
        strong_model = make_test_model(5, block_size=32, vocab_size=512, n_head=4, **LLAMA_CHOICES)
        model = exported(strong_model, tmp_path)
        assert model.empty_past(1)[0].shape == (1, 1, 0, strong_model.config.head_dim)
    block_size = strong_model.config.block_size
    prompts = [[464, 68], [17, 329, 11, 290, 262, 110], [40]]
    recording = RecordingModel(model)
    greedy = SamplingParams(max_tokens=block_size, ignore_eos=True)
    results = onnx_generate.generate_batch(recording, prompts, greedy, keep_logits=True)
    # A prefill of the longest prompt (others left-padded), then one token per step until
    # the shortest prompt's row has filled its context.
    assert recording.calls[0] == (0, 6)
    assert recording.calls[-1] == (6 + block_size - 2, 1)
    assert_rows_match_oracle(results, [oracle(strong_model, prompt) for prompt in prompts])


def test_one_graph_for_every_shape(hf_onnx: OnnxModel, hf_model: GPT) -> None:
    """Exported with 2 rows, 3 past and 4 new tokens; it runs at others, and names its
    inputs and outputs as Hugging Face's exporters do."""
    n_layer = hf_model.config.n_layer
    session = hf_onnx.session
    assert [i.name for i in session.get_inputs()] == onnx_generate.input_names(n_layer)
    assert [o.name for o in session.get_outputs()] == onnx_generate.output_names(n_layer)
    shapes = {io.name: io.shape for io in [*session.get_inputs(), *session.get_outputs()]}
    assert shapes["input_ids"] == ["batch_size", "sequence_length"]
    assert shapes["attention_mask"] == ["batch_size", "past_sequence_length + sequence_length"]
    assert shapes["past_key_values.0.key"][:3] == ["batch_size", 6, "past_sequence_length"]
    assert shapes["present.2.value"][2] == "past_sequence_length + sequence_length"

    decoder = export_onnx.DecoderWithPast(hf_model)
    for batch, past, new, pads in [(5, 7, 3, [0, 1, 0, 4, 2]), (1, 0, 9, [0]), (4, 11, 1, None)]:
        ids, mask, positions, past_kv = export_onnx.example_inputs(
            hf_model.config, batch, past, new, pads
        )
        with torch.no_grad():
            want, want_present = decoder(ids, mask, positions, past_kv)
        flat = [t.numpy() for kv in past_kv for t in kv]
        got, present = hf_onnx(ids.numpy(), mask.numpy(), positions.numpy(), flat)
        assert got.shape == (batch, new, hf_model.config.vocab_size)
        assert_logits_close(torch.from_numpy(got), want)
        assert present[0].shape == (batch, 6, past + new, 32)
        assert_logits_close(torch.from_numpy(present[-1]), want_present[-1][1])


def test_the_export_wrote_its_json(hf_export: Path, hf_model: GPT, hf_gpt2_dir: Path) -> None:
    meta = json.loads((hf_export / onnx_generate.META_FILE).read_text())
    config = hf_model.config
    assert meta["n_layer"] == config.n_layer and meta["n_head"] == config.n_head
    assert meta["block_size"] == config.block_size and meta["vocab_size"] == config.vocab_size
    assert meta["eot_id"] == 50256 and meta["tokenizer_name"] == "gpt2"
    assert meta["inputs"] == onnx_generate.input_names(config.n_layer)
    assert meta["source"] == str(hf_gpt2_dir)
    assert not list(hf_export.glob("*.data"))  # small models: one file


# -- the loop without torch --


def test_a_hugging_face_export_equals_its_oracle(hf_onnx: OnnxModel, hf_model: GPT) -> None:
    prompts = [[464, 2068, 7586], [40]]
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    results = onnx_generate.generate_batch(hf_onnx, prompts, greedy, keep_logits=True)
    for prompt, result in zip(prompts, results, strict=True):
        want = generate(hf_model, prompt, greedy, use_cache=False, keep_logits=True)
        assert_clear_margins(want.step_logits)
        assert result.token_ids == want.token_ids
        for a, b in zip(result.step_logits, want.step_logits, strict=True):
            assert_logits_close(torch.from_numpy(a), b)


def test_the_loop_runs_without_torch(hf_export: Path, hf_onnx: OnnxModel) -> None:
    script = f"""
import sys
from roseinfer.loops.onnx_generate import OnnxModel, generate_batch
from roseinfer.request.sampling_params import SamplingParams
model = OnnxModel({str(hf_export)!r}, threads=1)
greedy = SamplingParams(max_tokens=12, ignore_eos=True)
[result] = generate_batch(model, [[464, 2068]], greedy)
print(result.token_ids)
print("torch imported:", "torch" in sys.modules)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    tokens, imported = done.stdout.splitlines()
    assert imported == "torch imported: False"
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    [here] = onnx_generate.generate_batch(hf_onnx, [[464, 2068]], greedy)
    assert tokens == str(here.token_ids)


def test_numpy_filters_keep_what_the_torch_filters_keep() -> None:
    generator = torch.Generator().manual_seed(0)
    # Rounded logits: many exact ties, where the filters' tie rules matter.
    logits = (torch.randn(6, 300, generator=generator) * 2).round()
    for k in (1, 5, 37, 299):
        want = top_k_filter(logits, k).numpy()
        got = np.stack([onnx_generate.top_k_filter(row.numpy(), k) for row in logits])
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    for p in (0.05, 0.5, 0.9, 0.999):
        want = top_p_filter(logits, p).numpy()
        got = np.stack([onnx_generate.top_p_filter(row.numpy(), p) for row in logits])
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want))


def test_seeded_sampling_repeats_and_the_seed_matters(onnx_model: OnnxModel) -> None:
    def sample(seed: int) -> list[int]:
        params = SamplingParams(
            max_tokens=16, temperature=1.5, top_k=50, top_p=0.95, seed=seed, ignore_eos=True
        )
        [result] = onnx_generate.generate_batch(onnx_model, [[464]], params)
        return result.token_ids

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_stops_at_end_of_text_and_at_a_stop_string(onnx_model: OnnxModel) -> None:
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    [free] = onnx_generate.generate_batch(onnx_model, [[464]], greedy)
    third = free.token_ids[2]
    # The third token as end-of-text: the row stops there and does not keep it.
    [stopped] = onnx_generate.generate_batch(
        onnx_model, [[464]], SamplingParams(max_tokens=20), eot_id=third
    )
    assert stopped.token_ids == free.token_ids[:2]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", third)

    # A stop string: decode as letters so the text is known; the completing token is kept.
    def decode(ids: list[int]) -> str:
        return "".join(chr(65 + i % 26) for i in ids)

    stop = decode(free.token_ids[3:5])
    params = SamplingParams(max_tokens=20, ignore_eos=True, stop=(stop,))
    streamed = []
    [by_text] = onnx_generate.generate_batch(
        onnx_model, [[464]], params, decode=decode, on_token=lambda row, t: streamed.append(t)
    )
    assert stop in decode(by_text.token_ids)
    assert by_text.token_ids == free.token_ids[: len(by_text.token_ids)]
    assert len(by_text.token_ids) <= 5 and by_text.stop_reason == stop
    assert streamed == by_text.token_ids


# -- a rose checkpoint, the exporter's and the generator's command lines --


@pytest.fixture(scope="module")
def rose_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny rose checkpoint's run directory, and its export through the command line."""
    run_dir = tmp_path_factory.mktemp("onnx_rose")
    torch.manual_seed(0)
    state = {
        "model": GPT(TINY).state_dict(),
        "model_config": TINY.to_dict(),
        "tokenizer_name": "gpt2",
    }
    save_checkpoint(run_dir / "best.pt", state)
    out = run_dir / "onnx"
    code, stdout = export_cli("--checkpoint-path", run_dir, "--out", out)
    assert code == 0
    assert_checked_itself(stdout)
    assert f"model: {run_dir / 'best.pt'}" in stdout
    return run_dir, out


def generate_cli(capsys: pytest.CaptureFixture, *args: str | Path) -> tuple[int, str, str]:
    code = cli_generate.main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_generate_onnx_equals_the_torch_path(
    rose_export: tuple[Path, Path], capsys: pytest.CaptureFixture
) -> None:
    run_dir, out = rose_export
    prompts = ["--prompt", "ROMEO:", "--prompt", "Hello, 世界"]
    common = [*prompts, "--temperature", "0", "--max-new-tokens", "12", "--no-stop-at-eot"]
    code, onnx_json, err = generate_cli(capsys, "--onnx", out, *common, "--json")
    assert code == 0, err
    assert "[roseinfer] device: cpu (onnxruntime)" in err.splitlines()
    code, torch_json, _ = generate_cli(capsys, "--checkpoint-path", run_dir, *common, "--json")
    assert code == 0
    onnx_rows = [json.loads(line) for line in onnx_json.splitlines()]
    torch_rows = [json.loads(line) for line in torch_json.splitlines()]
    for got, want in zip(onnx_rows, torch_rows, strict=True):
        assert set(got) == set(want)  # the same JSON shape
        for field in ("prompt", "prompt_token_ids", "token_ids", "text", "finish_reason"):
            assert got[field] == want[field], field
    # One prompt streams; the streamed text is the JSON's.
    code, streamed, _ = generate_cli(capsys, "--onnx", out, *common[4:], "--prompt", "ROMEO:")
    assert code == 0
    assert streamed == "ROMEO:" + onnx_rows[0]["text"] + "\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--onnx", "{missing}"], r"model\.onnx not found: export a model there first"),
        (["--onnx", "{out}", "--compile"], r"--onnx runs the exported graph .* drop"),
        (["--onnx", "{out}", "--cache", "concat"], r"--onnx runs the exported graph"),
        (["--onnx", "{out}", "--dtype", "bfloat16"], r"float32 graph on the CPU"),
        (["--onnx", "{out}", "--checkpoint-path", "x.pt"], r"not allowed with argument"),
    ],
)
def test_cli_generate_onnx_mistakes(
    args: list[str], message: str, rose_export: tuple[Path, Path], capsys: pytest.CaptureFixture
) -> None:
    run_dir, out = rose_export
    filled = [a.format(out=out, missing=run_dir / "nowhere") for a in args]
    code, stdout, err = generate_cli(capsys, *filled, "--prompt", "hi")
    assert (code, stdout) == (2, "")
    [line] = err.splitlines()
    assert line.startswith("[roseinfer] error: ") and re.search(message, line), line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--opset", "11"], r"--opset 11 is not supported: the exporter writes opsets 18\.\."),
        (["--out", "{file}"], r"--out .* is a file: give a directory"),
        (["--checkpoint-path", "{missing}"], r"nowhere"),
    ],
)
def test_export_mistakes_are_one_line(
    args: list[str], message: str, rose_export: tuple[Path, Path], capsys: pytest.CaptureFixture
) -> None:
    run_dir, out = rose_export
    filled = [a.format(file=run_dir / "best.pt", missing=run_dir / "nowhere.pt") for a in args]
    if "--out" not in filled:
        filled += ["--out", str(run_dir / "unused")]
    if "--checkpoint-path" not in filled:
        filled += ["--checkpoint-path", str(run_dir)]
    code = export_command.main(filled)
    stdout, err = capsys.readouterr()
    assert code == 2
    [line] = err.splitlines()
    assert line.startswith("[rose-export-onnx] error: ") and re.search(message, line), line


@pytest.mark.parametrize("failure", ["full disk", "Ctrl-C"])
def test_a_write_that_fails_midway_leaves_no_graph(
    failure: str, rose_export: tuple[Path, Path], tmp_path: Path, monkeypatch, capsys
) -> None:
    """Half of model.onnx written, then the disk is full (or Ctrl-C): one line, and no
    half graph left behind for a runtime to load (issue 33)."""

    def half_then_fail(model: GPT, path: Path, opset: int) -> None:
        path.write_bytes(b"\x08\x09half a graph")
        if failure == "Ctrl-C":
            raise KeyboardInterrupt
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export_command, "export", half_then_fail)
    out = tmp_path / "onnx"
    code = export_command.main(["--checkpoint-path", str(rose_export[0]), "--out", str(out)])
    err = capsys.readouterr().err.splitlines()
    if failure == "Ctrl-C":
        assert (code, err) == (130, ["[rose-export-onnx] interrupted: stopped by Ctrl-C"])
    else:
        assert code == 2 and len(err) == 1, err
        assert f"cannot write {out / 'model.onnx'}: no space left on the device" in err[0]
    assert list(out.iterdir()) == []
