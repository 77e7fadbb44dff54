"""Shared fixtures: where the offline files live (../shared next to the repo)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    return REPO_ROOT.parent / "shared"


@pytest.fixture(scope="session")
def tinyshakespeare_path(shared_dir: Path) -> Path:
    return shared_dir / "data" / "tinyshakespeare.txt"


@pytest.fixture(scope="session")
def text_file(tmp_path_factory: pytest.TempPathFactory, tinyshakespeare_path: Path) -> Path:
    """The first 20,000 characters of TinyShakespeare (~5,000 tokens), for short runs."""
    path = tmp_path_factory.mktemp("text") / "shakespeare.txt"
    path.write_text(tinyshakespeare_path.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    return path


@pytest.fixture(scope="session", autouse=True)
def tiktoken_cache(shared_dir: Path) -> Iterator[str]:
    """Let tiktoken find the GPT-2 BPE files offline (subprocesses inherit it too).

    Session-scoped so that module-scoped fixtures which tokenise already see it.
    """
    cache = os.environ.get("TIKTOKEN_CACHE_DIR") or str(shared_dir / "tiktoken_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_CACHE_DIR", cache)
        yield cache


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_reaches_children() -> Iterator[None]:
    """Tests press Ctrl-C on the programs they start (SIGINT), as a terminal does to a
    foreground program. A shell without job control starts its `cmd &` with SIGINT
    ignored, and an ignored signal stays ignored through fork and exec: pytest started
    that way would hand every program it starts a deaf Ctrl-C, and each of those tests
    would hang. So SIGINT is Python's default here, whatever the runner was given."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session", autouse=True)
def engines_record_their_writes() -> Iterator[None]:
    """Every engine the tests build (chapters' kernels and servers' processes included)
    records what each step wrote (EngineConfig.record_writes), so that a test can check
    its block pool's invariants after every step (block_manager.check_pool)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ROSE_RECORD_WRITES", "1")
        yield


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models on a shared 2-core machine: one intra-op thread is several times faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def hf_gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Hugging Face GPT-2, written by save_pretrained (no weights can be downloaded).

    initializer_range=0.2 (GPT-2 uses 0.02) makes every weight move the logits: greedy
    tokens are varied and win by clear margins.
    """
    from transformers import GPT2Config, GPT2LMHeadModel  # slow import: only when asked for

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=3,
        n_head=6,
        n_embd=192,
        n_positions=96,
        vocab_size=50257,
        initializer_range=0.2,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )
    directory = tmp_path_factory.mktemp("hf_gpt2")
    GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory holding a random `tiny` preset model (models.write_random_checkpoint),
    its vocabulary padded to 50,304 rows as a trainer pads it: what rose-export-hf exports."""
    from models import write_random_checkpoint

    from rosetrainer.config import GPTConfig

    run = tmp_path_factory.mktemp("run")
    write_random_checkpoint(run / "last.pt", GPTConfig.from_preset("tiny", vocab_size=50304))
    return run


@pytest.fixture(scope="session")
def tiny_hf_export(tiny_run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_run_dir's model as rose-export-hf writes it: a Hugging Face GPT-2 folder."""
    from roseinfer.cli.export_hf import main

    out = tmp_path_factory.mktemp("export") / "hf"
    assert main(["--checkpoint-path", str(tiny_run_dir), "--out", str(out)]) == 0
    return out


# The test files whose assertions hold a path's logits to the oracle's within float32
# rounding. CI runs them a second time on another of PyTorch's CPU kernel paths
# (ATEN_CPU_CAPABILITY, see .ci/run), where the rounding falls differently.
ORACLE_TEST_FILES = {
    "test_batching.py",
    "test_builds.py",
    "test_engine.py",
    "test_engine_api.py",
    "test_engine_quant.py",
    "test_engine_speculative.py",
    "test_exercises.py",
    "test_generate.py",
    "test_hf_generate.py",
    "test_hf_parity.py",
    "test_invariants.py",
    "test_onnx.py",
    "test_pipeline.py",
    "test_quant.py",
    "test_rolling.py",
    "test_rotary.py",
    "test_speculative.py",
    "test_course.py",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in ORACLE_TEST_FILES:
            item.add_marker(pytest.mark.oracle)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The worst logit gap each test file saw, against its tolerance (tests/models.py)."""
    from models import WORST_LOGIT_GAPS

    if not WORST_LOGIT_GAPS:
        return
    capability = torch.backends.cpu.get_cpu_capability()
    terminalreporter.section(f"largest logit gap per test file (CPU kernels: {capability})")
    for family, (ratio, gap, tolerance) in sorted(WORST_LOGIT_GAPS.items()):
        terminalreporter.write_line(
            f"{family:<34} {gap:.2e} of {tolerance:.1e} allowed ({ratio:.0%})"
        )
