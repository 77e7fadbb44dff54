"""Shared fixtures: where the offline files live (../shared next to the repo); and how
the suite runs in parallel (pytest-xdist, `-n auto --dist loadgroup` in pyproject's addopts).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

# pytest-xdist runs the tests in one worker process per core (`-n auto`, pyproject's
# addopts). Each worker, and every program a test starts (notebook kernels, servers,
# command lines), gets one intra-op thread: the models are tiny, and with a worker on each
# core a second OpenMP thread has no core of its own; it spin-waits against the other
# worker instead of helping (the quick subset on 2 shared cores, two workers: 7.7 min, 6.8
# of CPU, with 2 threads each; 6.6 min, 5.6 of CPU, with 1). Set at import, before any
# test runs, so that what a test starts inherits it; a worker has PYTEST_XDIST_WORKER_COUNT
# before its conftest loads.
PARALLEL = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1
if PARALLEL:
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"

# The most workers `-n auto` starts: each holds torch and its own models (1 GB here at its
# peak), and at times a notebook kernel or a server beside it.
MAX_WORKERS = 4


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker per core this process may run on (its affinity, not the
    machine's count), at most MAX_WORKERS; PYTEST_XDIST_AUTO_NUM_WORKERS overrides. One
    core: no workers at all, the tests run in pytest's own process as without xdist."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = min(cores or 1, MAX_WORKERS)
    return workers if workers > 1 else 0


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
    its vocabulary padded to 50,304 rows as rose-train pads it (vocab_multiple): what
    rose-export-hf exports."""
    from models import write_random_checkpoint

    from rosetrainer.config import GPTConfig

    run = tmp_path_factory.mktemp("run")
    write_random_checkpoint(run / "last.pt", GPTConfig.from_preset("tiny", vocab_multiple=64))
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


# Tests in the oracle files that check that a wrong answer is caught (a known wrong answer
# with its diagnosis, a mutant): a wrong answer misses the oracle by far more than the
# rounding another kernel path moves, so their verdicts do not hang on a tolerance, and
# the second pass leaves them out (1.4 of its 6.3 min of CPU here). A test renamed is
# marked again.
CAUGHT_WRONG_ANSWER_TESTS = {
    "test_builds.py": {
        "test_mutant_fails",
        "test_known_wrong_answer_fails_with_its_diagnosis",
        "test_a_wrong_answer_of_a_general_class_fails_naming_the_clause",
        "test_the_verdict_is_the_graders_whatever_the_checks_process_says",
    },
    "test_course.py": {"test_known_wrong_answer_gets_its_diagnosis"},
    "test_exercises.py": {"test_known_wrong_answer_is_caught_with_its_step_and_explanation"},
}

# Module-scoped fixtures that cost seconds to make (a server started, a site built, a
# browser opened, a model trained or exported, a text tokenised): xdist's loadgroup sends
# the tests of one module that use one of them to one worker (an xdist_group named after
# the module), so that it is made once a run, not once a worker.
SHARED_MODULE_FIXTURES = {
    "server",  # test_serve*.py, test_structured_serve.py, test_structured_hostile.py, test_live_page.py
    "browser",  # test_live_page.py: a headless Chromium on that server
    "site",  # test_docs.py: mkdocs build --strict
    "finished_run",  # test_protects.py: a short training run
    "straight_and_resumed",  # test_train.py: two training runs
    "hf_export",  # test_onnx.py: three ONNX exports, 8-10 s each
    "onnx_model",
    "rose_export",
    "shakespeare",  # test_data.py: TinyShakespeare tokenised whole
}
# Tests that share what one process caches: the max-autotune compile of the one-token step
# (20-40 s) is made once and read back by the test after it (78 s alone, 2 s after it).
SHARED_PROCESS_TESTS = {
    "test_generate.py": {
        "test_compiled_static_decode_equals_oracle",
        "test_frozen_decode_step_is_not_reused_for_other_weights",
    },
}


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups off the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        name, function = item.path.name, getattr(item, "originalname", item.name)
        if name in ORACLE_TEST_FILES and function not in CAUGHT_WRONG_ANSWER_TESTS.get(name, ()):
            item.add_marker(pytest.mark.oracle)
        if SHARED_MODULE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
        elif function in SHARED_PROCESS_TESTS.get(name, ()):
            item.add_marker(pytest.mark.xdist_group(f"{item.path.stem}-compiled"))
    if PARALLEL:
        # The slow tests first (each worker collects the same list, and the controller hands
        # the tests out in its order, the groups first): the quick ones fill in at the end,
        # so that no worker is left waiting on a minute-long test started last.
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker hands the worst logit gaps it saw to the controlling process."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        from models import WORST_LOGIT_GAPS

        workeroutput["worst_logit_gaps"] = {
            family: list(worst) for family, worst in WORST_LOGIT_GAPS.items()
        }


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """The controlling process keeps each test file's worst gap over its workers."""
    from models import WORST_LOGIT_GAPS

    for family, worst in getattr(node, "workeroutput", {}).get("worst_logit_gaps", {}).items():
        if worst[0] >= WORST_LOGIT_GAPS.get(family, (-1.0,))[0]:
            WORST_LOGIT_GAPS[family] = tuple(worst)


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
