"""The trainer: schedule, activation checkpointing, exact resume, configs, errors, Ctrl-C."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from training import tiny_run, train_losses

from roseinfer.cache.dense import ConcatKVCache
from rosetrainer import model as model_module
from rosetrainer import runtime
from rosetrainer.checkpoint import load_checkpoint, load_model
from rosetrainer.config import LLAMA, GPTConfig, TrainConfig
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT
from rosetrainer.numerics import logit_tolerance
from rosetrainer.schedule import learning_rate_at
from rosetrainer.train import main, resolve_configs

# ---------------------------------------------------------------------------
# The learning-rate schedule
# ---------------------------------------------------------------------------


def test_learning_rate_warms_up_linearly_then_decays_by_cosine_to_min_lr() -> None:
    cfg = TrainConfig(learning_rate=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    # Warmup: step s (0-based) gets (s + 1) / 10 of the peak.
    assert learning_rate_at(0, cfg) == pytest.approx(1e-4)
    assert learning_rate_at(4, cfg) == pytest.approx(5e-4)
    assert learning_rate_at(9, cfg) == pytest.approx(1e-3)
    # Cosine over steps 10..110: the peak at its start, halfway between at its middle.
    assert learning_rate_at(10, cfg) == pytest.approx(1e-3)
    assert learning_rate_at(60, cfg) == pytest.approx(5.5e-4)
    assert learning_rate_at(35, cfg) == pytest.approx(1e-4 + 9e-4 * (1 + math.cos(math.pi / 4)) / 2)
    decay = [learning_rate_at(s, cfg) for s in range(10, 111)]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))
    # From lr_decay_steps (default max_steps) on: min_lr, for a run extended past it too.
    assert learning_rate_at(110, cfg) == pytest.approx(1e-4)
    assert learning_rate_at(500, cfg) == pytest.approx(1e-4)


def test_lr_decay_steps_sets_the_schedule_length_independently_of_max_steps() -> None:
    cfg = TrainConfig(
        learning_rate=1e-3, min_lr=0.0, warmup_steps=0, max_steps=50, lr_decay_steps=200
    )
    assert learning_rate_at(100, cfg) == pytest.approx(5e-4)  # halfway through the decay
    assert learning_rate_at(49, cfg) > 5e-4


# ---------------------------------------------------------------------------
# Activation checkpointing
# ---------------------------------------------------------------------------


def test_activation_checkpointing_gives_the_same_loss_and_every_gradient() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=300, block_size=32, n_layer=3, n_head=2, n_embd=32)).train()
    idx = torch.randint(300, (4, 32))
    targets = torch.randint(300, (4, 32))

    def run(checkpointing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        """Loss, gradients, and how many numbers the forward kept for the backward."""
        model.zero_grad(set_to_none=True)
        model.activation_checkpointing = checkpointing
        kept = []

        def count(tensor: torch.Tensor) -> torch.Tensor:
            kept.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
            loss = model(idx, targets).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(kept)

    loss_plain, grads_plain, kept_plain = run(checkpointing=False)
    loss_ckpt, grads_ckpt, kept_ckpt = run(checkpointing=True)

    assert kept_ckpt < kept_plain / 2, "checkpointing must keep fewer activations for backward"
    # The checkpointed loss is summed over slices of the sequence, then divided: the same
    # sum in another order, so equal up to float32 rounding.
    torch.testing.assert_close(loss_ckpt, loss_plain, rtol=1e-6, atol=0)
    assert grads_ckpt.keys() == grads_plain.keys()
    for name, grad in grads_plain.items():
        assert grad.abs().sum() > 0, f"{name} got no gradient"
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-5, atol=1e-7, msg=name)


# ---------------------------------------------------------------------------
# The loss, a slice of rows at a time (model.linear_cross_entropy)
# ---------------------------------------------------------------------------

LOSS_SHAPES = {
    "gpt2, tied": dict(),
    "gpt2, 300 ids in 320 rows": dict(vocab_multiple=64),
    "llama, untied": dict(**LLAMA, n_kv_head=1, tie_embeddings=False),
}


def loss_model(shape: str) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=32)
    return GPT(GPTConfig(**{**config.to_dict(), **LOSS_SHAPES[shape]})).train()


def loss_and_grads(
    model: GPT, loss_of: Callable[[], torch.Tensor], autocast: bool = False
) -> list[tuple[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = loss_of()
    loss.backward()
    return [("loss", loss.detach()), *((n, p.grad.clone()) for n, p in model.named_parameters())]


def plain_loss(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The head as a textbook writes it: every logit, then F.cross_entropy over them."""
    logits = model(idx).logits
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def batch_with_ignored_targets() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(300, (4, 32), generator=generator).split(2)
    idx, targets = torch.cat([idx, idx]), torch.cat([targets, targets])
    targets[:, -5:] = -100  # the last positions of each row count in no loss
    targets[1, :] = -100  # nor does one whole row
    return idx, targets


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("shape", LOSS_SHAPES)
def test_the_sliced_loss_and_every_gradient_equal_plain_cross_entropy(
    shape: str, checkpointing: bool, monkeypatch
) -> None:
    # 128 rows in slices of 24: five whole slices and a short one
    monkeypatch.setattr(model_module, "LOSS_CHUNK_ROWS", 24)
    model, (idx, targets) = loss_model(shape), batch_with_ignored_targets()
    model.activation_checkpointing = checkpointing
    want = loss_and_grads(model, lambda: plain_loss(model, idx, targets))
    got = loss_and_grads(model, lambda: model(idx, targets).loss)
    assert [name for name, _ in got] == [name for name, _ in want]
    for (name, g), (_, w) in zip(got, want, strict=True):
        assert w.abs().sum() > 0, f"{name} got no gradient"
        gap = float((g - w).abs().max())
        assert gap <= logit_tolerance(w), f"{name}: {gap:.2e} from the plain loss's"
        if name in ("transformer.wte.weight", "lm_head.weight"):  # padding rows: no token
            assert not g[300:].any() and g.size(0) == model.config.padded_vocab_size
    with torch.no_grad():  # an eval computes it without gradients, the same way
        assert abs(float(model(idx, targets).loss) - float(want[0][1])) <= logit_tolerance(
            want[0][1]
        )


@pytest.mark.parametrize("shape", LOSS_SHAPES)
def test_under_bfloat16_autocast_the_sliced_loss_is_as_exact_as_the_plain_one(
    shape: str, monkeypatch
) -> None:
    """In bfloat16 the logits and their gradients are rounded to 8 bits of mantissa, so
    two orders of the same products differ by more than float32's rule: the sliced loss is
    held to the plain bfloat16 loss's own distance from the float32 computation."""
    monkeypatch.setattr(model_module, "LOSS_CHUNK_ROWS", 24)
    model, (idx, targets) = loss_model(shape), batch_with_ignored_targets()
    exact = loss_and_grads(model, lambda: plain_loss(model, idx, targets))
    plain = loss_and_grads(model, lambda: plain_loss(model, idx, targets), autocast=True)
    sliced = loss_and_grads(model, lambda: model(idx, targets).loss, autocast=True)
    loss_gap = float((sliced[0][1] - plain[0][1]).abs())
    assert loss_gap <= logit_tolerance(plain[0][1]), "the loss itself is plain's to float32's rule"
    for (name, e), (_, p), (_, s) in zip(exact, plain, sliced, strict=True):
        plain_error, sliced_error = (p - e).abs().max(), (s - e).abs().max()
        assert sliced_error <= 1.5 * plain_error + logit_tolerance(e), (
            f"{name}: {sliced_error:.2e} from float32, the plain bfloat16 loss {plain_error:.2e}"
        )


def test_the_loss_never_keeps_logits_for_the_backward() -> None:
    model, (idx, targets) = loss_model("gpt2, tied"), batch_with_ignored_targets()
    kept = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        kept.append(tensor.shape)
        return tensor

    def logits_kept() -> list[torch.Size]:
        """Tensors of logits (rows, vocab) the forward kept (a weight is (vocab, n_embd))."""
        return [shape for shape in kept if shape and shape[-1] >= model.config.vocab_size]

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        plain_loss(model, idx, targets)
    assert logits_kept(), "the plain head keeps its logits (the hook sees them)"
    kept.clear()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(idx, targets).loss.backward()
    assert kept and not logits_kept()


@pytest.mark.slow
def test_the_sliced_loss_compiles_into_one_graph_with_the_same_loss_and_gradients(
    monkeypatch,
) -> None:
    """torch.compile (the GPU's training step) traces the loss whole, no graph break."""
    monkeypatch.setattr(model_module, "LOSS_CHUNK_ROWS", 24)
    model, (idx, targets) = loss_model("gpt2, 300 ids in 320 rows"), batch_with_ignored_targets()
    want = loss_and_grads(model, lambda: model(idx, targets).loss)
    compiled = torch.compile(model, fullgraph=True)
    got = loss_and_grads(model, lambda: compiled(idx, targets, validate=False).loss)
    for (name, g), (_, w) in zip(got, want, strict=True):
        assert float((g - w).abs().max()) <= logit_tolerance(w), name


# ---------------------------------------------------------------------------
# The vocabulary padded for training (GPTConfig.vocab_multiple)
# ---------------------------------------------------------------------------


def test_padding_rows_are_never_a_logit_nor_a_sampled_id() -> None:
    """Padding rows made to win every argmax and draw, were they ever scored."""
    from roseinfer.pipeline.stage import PipelineStage
    from rosetrainer.sample import generate

    config = GPTConfig(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=32)
    model = GPT(dataclasses.replace(config, vocab_multiple=64)).eval()
    assert model.lm_head.weight.shape == (320, 32)  # 300 rounded up to 5 x 64
    with torch.no_grad():
        model.lm_head.weight[300:] = 1000.0 * model.lm_head.weight[:20]
        ids = torch.tensor([[1, 2, 3]])
        assert model(ids).logits.shape == (1, 3, 300)
        sampled = generate(model, ids, 20, generator=torch.Generator().manual_seed(0))
        assert int(sampled.max()) < 300
        whole = model(ids).logits[:, -1]
        stage_logits = PipelineStage(model, 0, 1)(ids, ConcatKVCache())  # (a split model's)
        assert stage_logits.shape == whole.shape == (1, 300)
        assert float((stage_logits - whole).abs().max()) <= logit_tolerance(whole)
    with pytest.raises(RoseError, match="outside the vocabulary"):
        model(torch.tensor([[300]]))  # a padding row is no input either


def test_a_new_run_pads_its_vocabulary_and_vocab_multiple_1_does_not() -> None:
    padded, _ = resolve_configs({"preset": "tiny"})
    assert (padded.vocab_size, padded.vocab_multiple, padded.padded_vocab_size) == (
        50257, 64, 50304
    )  # fmt: skip
    plain, _ = resolve_configs({"preset": "tiny", "vocab_multiple": 1})
    assert plain.padded_vocab_size == 50257


def test_a_checkpoint_from_before_the_padding_loads_and_resumes_unpadded(
    text_file: Path, tmp_path: Path
) -> None:
    """A run saved before vocab_multiple existed: its model_config has no such key, and its
    matrices have the vocabulary's 50,257 rows."""
    run = tmp_path / "old"
    assert main(tiny_run(text_file, run, "--max-steps", "2", "--vocab-multiple", "1")) == 0
    ckpt = load_checkpoint(run / "last.pt")
    del ckpt["model_config"]["vocab_multiple"]
    torch.save(ckpt, run / "last.pt")
    model, _ = load_model(run / "last.pt")
    assert model.transformer.wte.weight.shape[0] == model.config.vocab_size == 50257
    assert main(tiny_run(text_file, run, "--max-steps", "4", "--resume")) == 0
    resumed = load_checkpoint(run / "last.pt")
    assert resumed["step"] == 4 and resumed["model_config"]["vocab_multiple"] == 1
    assert resumed["model"]["lm_head.weight"].shape[0] == 50257


# ---------------------------------------------------------------------------
# Exact resume, through the command line (in this process)
# ---------------------------------------------------------------------------

RESUME_FLAGS = ["--grad-accum-steps", "2", "--dropout", "0.1", "--eval-interval", "2"]


@pytest.fixture(scope="module")
def straight_and_resumed(
    text_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """6 steps in one go; and 3 steps (schedule still 6 long), stop, resume to 6."""
    root = tmp_path_factory.mktemp("runs")
    straight, resumed = root / "straight", root / "resumed"
    assert main(tiny_run(text_file, straight, *RESUME_FLAGS, "--max-steps", "6")) == 0
    first_half = [*RESUME_FLAGS, "--max-steps", "3", "--lr-decay-steps", "6"]
    assert main(tiny_run(text_file, resumed, *first_half)) == 0
    assert load_checkpoint(resumed / "last.pt")["step"] == 3
    # Only what may change is given: everything else comes from the checkpoint.
    assert main(["--checkpoint-path", str(resumed), "--resume", "--max-steps", "6"]) == 0
    return straight, resumed


@pytest.mark.slow
def test_resume_continues_exactly_where_the_run_stopped(
    straight_and_resumed: tuple[Path, Path],
) -> None:
    straight, resumed = straight_and_resumed
    straight_losses = train_losses(straight)
    assert [step for step, _ in straight_losses] == [1, 2, 3, 4, 5, 6]
    assert train_losses(resumed) == straight_losses  # bit for bit: same weights, data, dropout

    final_straight = load_checkpoint(straight / "last.pt")
    final_resumed = load_checkpoint(resumed / "last.pt")
    assert final_resumed["step"] == final_straight["step"] == 6
    assert final_resumed["model"]["lm_head.weight"].shape[0] == 50304  # (padded, by default)
    for name, tensor in final_straight["model"].items():
        assert torch.equal(final_resumed["model"][name], tensor), name
    assert torch.equal(final_resumed["data_state"], final_straight["data_state"])


def test_a_checkpoint_holds_the_whole_training_state(
    straight_and_resumed: tuple[Path, Path],
) -> None:
    straight, _ = straight_and_resumed
    ckpt = load_checkpoint(straight / "last.pt")  # weights_only=True: plain data only
    assert (
        ckpt["model_config"]
        == GPTConfig(
            n_layer=2, n_head=2, n_embd=32, block_size=32, dropout=0.1, vocab_multiple=64
        ).to_dict()
    )
    assert ckpt["train_config"]["grad_accum_steps"] == 2
    assert ckpt["optimizer"]["state"], "AdamW moments must be saved"
    assert ckpt["scaler"] is None  # float32: no loss scaling
    assert ckpt["tokenizer_name"] == "gpt2"
    assert set(ckpt["rng"]) == {"torch", "cuda", "python"}
    evals = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    val_losses = [r["val_loss"] for r in evals if r["kind"] == "eval"]
    assert len(val_losses) == 3  # steps 2, 4, 6
    assert ckpt["best_val_loss"] == min(val_losses)
    assert load_checkpoint(straight / "best.pt")["best_val_loss"] == min(val_losses)
    assert (straight / "loss.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--n-embd", "64"], "n_embd=64"),
        (["--block-size", "64"], "learned positions only up to there"),
        (["--batch-size", "8"], "batch_size=8"),
        (["--max-steps", "6"], "pass --max-steps larger than 6"),
    ],
)
def test_resume_refuses_settings_that_would_make_it_another_run(
    straight_and_resumed: tuple[Path, Path], flags: list[str], message: str
) -> None:
    straight, _ = straight_and_resumed
    args = {"checkpoint_path": str(straight), "resume": True, "max_steps": 10}
    for name, value in zip(flags[::2], flags[1::2], strict=True):
        args[name.removeprefix("--").replace("-", "_")] = int(value)
    with pytest.raises(RoseError, match=message):
        resolve_configs(args)


# ---------------------------------------------------------------------------
# Configs from a file and flags
# ---------------------------------------------------------------------------


def test_flags_override_the_config_file_which_overrides_the_preset(tmp_path: Path) -> None:
    config = tmp_path / "run.json"
    config.write_text(
        json.dumps(
            {
                "preset": "tiny",
                "model": {"n_layer": 2, "dropout": 0.2},
                "train": {"max_steps": 50, "batch_size": 3},
            }
        )
    )
    model_cfg, train_cfg = resolve_configs({"config": str(config), "max_steps": 7})
    assert (model_cfg.n_layer, model_cfg.n_embd, model_cfg.dropout) == (
        2,
        128,
        0.2,
    )  # n_embd: tiny's
    assert (train_cfg.max_steps, train_cfg.batch_size) == (7, 3)
    assert train_cfg.checkpoint_path == "checkpoints/tiny"


# ---------------------------------------------------------------------------
# Bad input: one line on stderr, exit code 2
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--preset", "gpt5"], "unknown preset 'gpt5'"),
        (["--max-steps", "-5"], "max_steps must be a positive integer"),
        (["--dtype", "float8"], "dtype must be float32, bfloat16 or float16"),
        (["--dtype", "float16", "--device", "cpu"], "float16 is not supported on CPU"),
        (["--lr-decay-steps", "0"], "lr_decay_steps must be a positive integer"),
        (["--config", "no/such/run.toml"], "config file not found"),
        (["--resume", "--checkpoint-path", "no/such/run"], "checkpoint not found"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("[rosetrainer.train] error: ") and message in err
    assert err.count("\n") == 1


def test_a_text_too_short_to_train_on_says_so_with_its_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A 2-byte text has a token or two: its training split was an empty token file,
    reported as "not a token file ... prepare the data again", which no preparing fixes."""
    text = tmp_path / "short.txt"
    text.write_text("hi")
    assert main([*tiny_run(text, tmp_path / "run"), "--block-size", "16"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # (after the tokenizing bar)
    assert re.fullmatch(
        rf"\[rosetrainer.train\] error: {re.escape(str(text))} is too short to train on: its "
        r"1 tokens split into 0 for training and 1 for validation \(--val-fraction 0.1\), "
        r"and a batch needs windows of block_size \+ 1 = 17 tokens from each; use a longer "
        r"text or a smaller --block-size",
        err,
    ), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_asking_for_cuda_without_a_gpu_is_a_clear_error(capsys: pytest.CaptureFixture) -> None:
    assert main(["--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_device_cuda_alone_sets_the_current_gpu_by_its_number(monkeypatch) -> None:
    """torch.cuda.set_device takes a GPU's number, and "cuda" has none: torch 2.11 on an
    H100 raised ValueError for every training run given --device cuda. (CUDA faked: the
    check is what set_device is handed; the real run is reported in the issue's note.)"""
    handed = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", handed.append)
    # (TF32 matmuls are set for CUDA runs: not in this process, whose CPU tests follow)
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda precision: None)
    rt = runtime.setup_device("cuda", "float32")
    assert handed == [torch.device("cuda", 0)] and rt.device == torch.device("cuda", 0)
    assert runtime.setup_device("cuda:1", "float32").device == torch.device("cuda", 1)
    assert handed[-1] == torch.device("cuda", 1)


@pytest.mark.slow
def test_resuming_from_a_corrupt_checkpoint_fails_cleanly_from_the_shell(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "last.pt").write_bytes(b"PK\x03\x04 not really a zip archive")
    done = subprocess.run(
        [sys.executable, "-m", "rosetrainer.train", "--resume", "--checkpoint-path", str(run_dir)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("[rosetrainer.train] error: checkpoint ")
    assert "truncated" in done.stderr and done.stderr.count("\n") == 1


# ---------------------------------------------------------------------------
# Ctrl-C and SIGTERM
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "exit_code"),
    [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
    ids=["ctrl-c", "sigterm"],
)
def test_ctrl_c_or_sigterm_saves_the_current_step_and_exits_128_plus_the_signal(
    signum: int, exit_code: int, text_file: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    flags = tiny_run(text_file, run_dir, "--max-steps", "100000", "--eval-interval", "100000")
    process = subprocess.Popen(
        [sys.executable, "-m", "rosetrainer.train", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 90
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "no training step was logged in time"
        time.sleep(0.1)
    process.send_signal(signum)
    out, err = process.communicate(timeout=60)

    assert process.returncode == exit_code, err
    assert "Traceback" not in err
    ckpt = load_checkpoint(run_dir / "last.pt")
    logged_steps = [step for step, _ in train_losses(run_dir)]
    assert ckpt["step"] == logged_steps[-1] >= 1  # the save is of the last finished step
    assert f"interrupted at step {ckpt['step']}" in out


@pytest.mark.slow
def test_sigterm_while_the_run_sets_up_removes_its_lock_and_saves_nothing(
    text_file: Path, tmp_path: Path
) -> None:
    """SIGTERM once the run's lock is taken, before the first step (data and model being
    set up): the run unwinds as from Ctrl-C, its lock file removed (Python's default
    handler ended the process at once and left train.lock behind)."""
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "rosetrainer.train", *tiny_run(text_file, run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 90
    while not (run_dir / "train.lock").exists():
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "the run took no lock in time"
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "[rosetrainer.train] SIGTERM: interrupted; nothing saved"
    assert "Traceback" not in err
    assert not (run_dir / "train.lock").exists() and not (run_dir / "last.pt").exists()


# ---------------------------------------------------------------------------
# The Llama-shaped preset: trains, resumes exactly, generates
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_the_tiny_llama_preset_trains_resumes_and_generates(
    text_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--preset tiny-llama (shrunk by the tests' flags, two query heads over one key/value
    head): 4 steps straight equal 2 steps, a stop and a resume to 4, bit for bit; then
    rose-generate's cached tokens from the run equal its uncached ones."""
    from roseinfer.cli.generate import main as generate_main

    llama = ["--preset", "tiny-llama", "--n-kv-head", "1", "--eval-interval", "2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(tiny_run(text_file, straight, *llama, "--max-steps", "4")) == 0
    assert (
        main(tiny_run(text_file, resumed, *llama, "--max-steps", "2", "--lr-decay-steps", "4")) == 0
    )
    assert main(["--checkpoint-path", str(resumed), "--resume", "--max-steps", "4"]) == 0
    assert train_losses(resumed) == train_losses(straight)
    saved = load_checkpoint(straight / "last.pt")
    config = GPTConfig.from_dict(saved["model_config"])
    assert (config.n_head, config.kv_heads, config.mlp, config.norm) == (2, 1, "swiglu", "rmsnorm")
    capsys.readouterr()
    runs = []
    for cache in ([], ["--no-kv-cache"]):
        flags = ["--checkpoint-path", str(straight), "--prompt", "ROMEO:", "--max-new-tokens", "12"]
        assert generate_main(["--json", "--seed", "1", *flags, *cache]) == 0
        runs.append(json.loads(capsys.readouterr().out.splitlines()[0])["token_ids"])
    assert runs[0] == runs[1] and len(runs[0]) == 12
