"""A model split across processes: every split equals the oracle, and no stage outlives a run.

The stage processes are real: torch.multiprocessing spawn, a gloo process group on a
loopback port, one torch thread each. Spawning is slow, so each run carries several
jobs (greedy and seeded sampling, ragged batches, with and without micro-batches, past
the context window) and their checks share it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import psutil
import pytest
import torch
from models import LLAMA_CHOICES, assert_clear_margins, assert_logits_close, make_test_model

from roseinfer.cache.dense import StaticKVCache, new_cache
from roseinfer.loops.generate import generate, generate_batch
from roseinfer.pipeline import PipelineJob, PipelineSetup, run_pipeline, stage_layers
from roseinfer.pipeline import stage as stage_module
from roseinfer.pipeline.runner import split_micro_batches
from roseinfer.pipeline.stage import PipelineStage
from roseinfer.request.sampling import SamplingParams
from rosetrainer.checkpoint import save_checkpoint
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT

N_LAYER = 4
PROMPTS = [[3, 14, 15, 92, 65], [35], [89, 79, 32, 38, 46, 26, 43], [38, 32]]  # ragged
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SAMPLED = [
    SamplingParams(max_tokens=10, temperature=0.8, top_k=40, seed=1),
    SamplingParams(max_tokens=10, temperature=1.2, seed=2),
    SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, seed=3),
    SamplingParams(max_tokens=10, temperature=1.0, top_k=5, top_p=0.8, seed=4),
]
# block_size is 32: these run past the context window (the cut and re-prefill policy)
PAST_WINDOW = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> GPT:
    return make_test_model(3, n_layer=N_LAYER)


def write_checkpoint(model: GPT, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pipeline") / "model.pt"
    save_checkpoint(path, {"model": model.state_dict(), "model_config": model.config.to_dict()})
    return path


@pytest.fixture(scope="module")
def checkpoint(model: GPT, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(model, tmp_path_factory)


@pytest.fixture(scope="module")
def rotary_model() -> GPT:
    return make_test_model(3, n_layer=N_LAYER, position_embedding="rotary")


@pytest.fixture(scope="module")
def rotary_checkpoint(rotary_model: GPT, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(rotary_model, tmp_path_factory)


@pytest.fixture(scope="module")
def llama_model() -> GPT:
    """Llama-shaped, four query heads over one key/value head: each stage's cache holds it."""
    return make_test_model(3, n_layer=N_LAYER, n_head=4, **LLAMA_CHOICES)


@pytest.fixture(scope="module")
def llama_checkpoint(llama_model: GPT, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(llama_model, tmp_path_factory)


@pytest.fixture
def no_stage_left() -> Iterator[None]:
    """Fail the test if any process it started is still running at its end. Not one that
    was there before it: an earlier test in this process may have started one that lives
    as long as the process by design (a grammar compile worker, inductor's compile pool),
    and with the tests spread over processes (pytest-xdist) which tests ran before is not
    the file order."""

    def children() -> set[psutil.Process]:  # a Process is its pid and its start time
        return set(psutil.Process().children(recursive=True))

    before = children()
    yield
    started = [p for p in children() - before if not is_helper(p)]
    _, alive = psutil.wait_procs(started, timeout=10)
    assert not alive, f"processes left running: {[p.pid for p in alive]}"


def is_helper(process: psutil.Process) -> bool:
    """multiprocessing's resource tracker: one per interpreter that ever spawned, by design
    alive until the interpreter exits (it is no stage)."""
    try:
        return "resource_tracker" in " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return True


def oracle_tokens(model: GPT, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    """Each prompt alone, uncached: the tokens every split must give."""
    if isinstance(params, SamplingParams):
        params = [params] * len(PROMPTS)
    return [
        generate(model, prompt, p, use_cache=False).token_ids
        for prompt, p in zip(PROMPTS, params, strict=True)
    ]


def stage_share(model: GPT, n_stages: int, stage: int) -> int:
    """Parameters of the whole model that belong to one stage (the tied head counted at
    the last stage, the embedding at the first)."""
    layers = stage_layers(model.config.n_layer, n_stages)[stage]
    names = {f"transformer.h.{i}." for i in layers}
    if stage == 0:
        names |= {"transformer.wte.", "transformer.wpe."}
    if stage == n_stages - 1:
        names |= {"transformer.ln_f.", "lm_head."}
    owned = {
        name: p
        for name, p in model.named_parameters(remove_duplicate=False)
        if any(name.startswith(prefix) for prefix in names)
    }
    return sum(p.numel() for p in owned.values())


# -- in one process: the split itself -------------------------------------------------


def test_layers_are_split_into_runs_and_bad_sizes_say_so() -> None:
    assert stage_layers(4, 3) == [range(0, 2), range(2, 3), range(3, 4)]
    assert stage_layers(12, 2) == [range(0, 6), range(6, 12)]
    with pytest.raises(RoseError, match="must be an integer >= 1, got 0"):
        stage_layers(4, 0)
    with pytest.raises(RoseError, match="more stages than the model's 4 layers"):
        stage_layers(4, 5)
    assert split_micro_batches(5, 2, None) == [range(0, 3), range(3, 5)]
    assert split_micro_batches(1, 2, None) == [range(0, 1)]  # fewer rows than stages: one
    with pytest.raises(RoseError, match=r"micro_batches must be in \[1, 3\]"):
        split_micro_batches(3, 2, 4)


def chained_logits(model: GPT, n_stages: int, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Greedy steps through the stages in this process, each stage on its own cache."""
    stages = [PipelineStage(model, s, n_stages) for s in range(n_stages)]
    caches = [new_cache(stage, "static", ids.size(0), model.config.block_size) for stage in stages]
    all_logits = []
    with torch.inference_mode():
        for _ in range(steps):
            x = ids
            for stage, cache in zip(stages, caches, strict=True):
                x = stage(x, cache)
            all_logits.append(x)
            ids = x.argmax(-1, keepdim=True)
    return all_logits


def test_a_stage_cache_indexed_by_global_layer_number_is_out_of_range(model: GPT) -> None:
    ids = torch.tensor([PROMPTS[0]])
    with (
        mock.patch.object(stage_module, "cache_slot", lambda layers, local: layers[local]),
        pytest.raises(IndexError, match="list index out of range"),
    ):
        chained_logits(model, 2, ids, steps=1)
    # with local numbers the chain equals the whole model, step by step
    expected = generate(model, PROMPTS[0], GREEDY, use_cache=False, keep_logits=True)
    assert_clear_margins(expected.step_logits)
    got = chained_logits(model, 3, ids, steps=GREEDY.max_tokens)
    assert [int(logits.argmax()) for logits in got] == expected.token_ids
    for step, (logits, want) in enumerate(zip(got, expected.step_logits, strict=True)):
        assert_logits_close(logits[0], want, f"step {step}: ")


def test_a_stage_holds_only_its_share_of_the_parameters(model: GPT) -> None:
    for n_stages in (2, 3):
        stages = [PipelineStage(model, s, n_stages) for s in range(n_stages)]
        for s, stage in enumerate(stages):
            assert stage.num_params() == stage_share(model, n_stages, s)
        # every block is in exactly one stage
        assert sum(len(stage.transformer.h) for stage in stages) == N_LAYER


# -- across processes ----------------------------------------------------------------


def pipeline_jobs() -> list[PipelineJob]:
    return [
        PipelineJob(PROMPTS, GREEDY),  # micro-batches: one per stage (default)
        PipelineJob(PROMPTS, GREEDY, dict(micro_batches=1, keep_caches=True)),
        PipelineJob(PROMPTS, SAMPLED, dict(schedule="lockstep")),
        PipelineJob(PROMPTS[:2], PAST_WINDOW, dict(micro_batches=2)),
    ]


@pytest.mark.slow
# Every stage turns its own layers' queries and keys, so rotary splits too (one case), and
# a Llama-shaped model's stages keep its key/value heads.
@pytest.mark.parametrize(
    "n_stages, position_embedding",
    [(2, "learned"), (3, "learned"), (2, "rotary"), (2, "llama")],
)
def test_split_model_equals_the_oracle(
    n_stages: int, position_embedding: str, request: pytest.FixtureRequest, no_stage_left: None
) -> None:
    prefix = "" if position_embedding == "learned" else f"{position_embedding}_"
    model = request.getfixturevalue(prefix + "model")
    checkpoint = request.getfixturevalue(prefix + "checkpoint")
    run = run_pipeline(PipelineSetup(str(checkpoint), n_stages), pipeline_jobs())
    micro, single, sampled, past_window = ([r.token_ids for r in job] for job in run.results)

    greedy_oracle = oracle_tokens(model, GREEDY)
    assert micro == greedy_oracle
    assert single == greedy_oracle
    assert sampled == oracle_tokens(model, SAMPLED)
    assert len(set(sum(sampled, []))) > 20  # the rows sampled, not one repeated token
    assert past_window == [
        generate(model, prompt, PAST_WINDOW, use_cache=False).token_ids for prompt in PROMPTS[:2]
    ]

    # micro-batches: every stage ran them side by side (one per stage, each its own cache)
    assert {span.group for span in run.stages[-1].timeline if span.job == 0} == set(range(n_stages))

    # the per-stage caches, stitched along the layers, are the single-process cache
    longest = max(map(len, PROMPTS))
    whole = StaticKVCache(model, batch_size=len(PROMPTS), max_len=longest + GREEDY.max_tokens)
    assert [r.token_ids for r in generate_batch(model, PROMPTS, GREEDY, cache=whole)] == single
    stitched = [pair for report in run.stages for pair in report.caches[1][0][0]]
    assert len(stitched) == N_LAYER
    for layer, (k, v) in enumerate(stitched):
        n = whole.seq_len
        assert k.shape == whole.layers[layer].k[:, :, :n].shape
        assert torch.allclose(k, whole.layers[layer].k[:, :, :n], atol=1e-6), layer
        assert torch.allclose(v, whole.layers[layer].v[:, :, :n], atol=1e-6), layer
    assert run.stages[1].caches[1][0][1] == whole.pad_lengths.tolist()

    # each stage loaded only its share of the weights
    for s, report in enumerate(run.stages):
        assert report.num_params == stage_share(model, n_stages, s)
    assert sum(r.num_params for r in run.stages) < 2 * model.num_params(non_embedding=False)


@pytest.mark.slow
def test_a_bad_request_stops_every_stage_with_its_error(
    model: GPT, checkpoint: Path, no_stage_left: None
) -> None:
    vocab = model.config.vocab_size
    jobs = [PipelineJob(PROMPTS[:1], GREEDY), PipelineJob([[1, vocab]], GREEDY)]
    with pytest.raises(RoseError, match=f"token id {vocab} is outside the vocabulary"):
        run_pipeline(PipelineSetup(str(checkpoint), 2), jobs)


def cli(checkpoint: Path, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "roseinfer.cli_generate", "--checkpoint-path", str(checkpoint),
        "--tokenizer-name", "gpt2", *flags,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def gpt2_vocab_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[GPT, Path]:
    """A model with GPT-2's vocabulary, so the CLI's tokenizer fits it."""
    model = make_test_model(1, n_layer=3, vocab_size=50257, block_size=64)
    path = tmp_path_factory.mktemp("pipeline_cli") / "model.pt"
    save_checkpoint(path, {"model": model.state_dict(), "model_config": model.config.to_dict()})
    return model, path


@pytest.mark.slow
def test_cli_split_over_three_processes_prints_the_oracle_tokens(
    gpt2_vocab_checkpoint: tuple[GPT, Path], no_stage_left: None
) -> None:
    model, path = gpt2_vocab_checkpoint
    flags = ["--pipeline-parallel-size", "3", "--temperature", "0", "--max-new-tokens", "8"]
    prompts = ["ROMEO:", "What light is that", "O"]
    flags += [arg for prompt in prompts for arg in ("--prompt", prompt)] + ["--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cli(path, *flags), capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pipeline: 3 stages (stage 0: layers 0-0, stage 1: layers 1-1, stage 2: layers 2-2)" in (
        done.stderr
    )
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [row["prompt"] for row in rows] == prompts
    greedy = SamplingParams(max_tokens=8)
    for row in rows:
        expected = generate(model, row["prompt_token_ids"], greedy, use_cache=False)
        assert row["token_ids"] == expected.token_ids


@pytest.mark.slow
def describe_processes(processes: list[psutil.Process]) -> str:
    """Each process's pid, state, signal masks (pending, blocked, ignored, caught) and, per
    thread, the kernel function it waits in."""
    lines = []
    for process in processes:
        try:
            waits = [
                Path(f"/proc/{process.pid}/task/{t.id}/wchan").read_text()
                for t in process.threads()
            ]
            status = Path(f"/proc/{process.pid}/status").read_text().splitlines()
            masks = [line for line in status if line.startswith(("SigPnd", "ShdPnd", "Sig"))]
            lines.append(
                f"{process.pid} {process.status()} {process.cmdline()[-2:]} {waits} {masks}"
            )
        except (psutil.Error, OSError) as err:
            lines.append(f"{process.pid}: {err!r}")
    return "\n".join(lines)


@pytest.mark.slow
def test_ctrl_c_stops_the_launcher_and_every_stage(
    gpt2_vocab_checkpoint: tuple[GPT, Path], no_stage_left: None
) -> None:
    _, path = gpt2_vocab_checkpoint
    # far past the context window: it runs until stopped
    flags = ["--pipeline-parallel-size", "2", "--max-new-tokens", "1000000", "--no-stop-at-eot"]
    # PYTHONFAULTHANDLER: should the launcher hang, SIGABRT makes it print where each of
    # its threads stands, and the failure below shows that
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    launcher = subprocess.Popen(
        cli(path, *flags, "--prompt", "ROMEO:"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert launcher.stdout.read(len("ROMEO:") + 1), "no token came out"  # it generates
        stages = psutil.Process(launcher.pid).children(recursive=True)
        assert len(stages) >= 2, stages
        launcher.send_signal(signal.SIGINT)
        try:
            _, stderr = launcher.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            hung = describe_processes([psutil.Process(launcher.pid), *stages])
            launcher.send_signal(signal.SIGABRT)
            _, stderr = launcher.communicate(timeout=30)
            pytest.fail(f"no exit 60 s after Ctrl-C: {hung}\n{stderr.decode()[-6000:]}")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 130, stderr.decode()[-2000:]
    assert "interrupted: stopped by Ctrl-C" in stderr.decode()
    _, alive = psutil.wait_procs(stages, timeout=10)
    assert not alive, f"stages left running after Ctrl-C: {[p.pid for p in alive]}"
    assert "Traceback" not in stderr.decode()
