"""Speculative decoding through the front doors: `cli_generate`, `LLM` and `rose-serve`
give the uncached greedy oracle's tokens with every draft kind, count drafts under
vLLM's metric names, and refuse bad settings in one line (exit 2) before anything runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from models import make_test_model, perturbed_copy
from servers import MODEL_NAME, running_server, solo_text, wait_idle, write_test_checkpoint

from roseinfer import cli_generate
from roseinfer.engine.llm import LLM
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams
from rosetrainer.checkpoint import save_checkpoint
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT
from rosetrainer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "To be, or not to be, that is the question: to be, or not"


def save(model: GPT, path: Path, tokenizer_name: str = "gpt2") -> Path:
    state = {"model": model.state_dict(), "model_config": model.config.to_dict()}
    save_checkpoint(path, {**state, "tokenizer_name": tokenizer_name})
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A two-layer target with GPT-2's vocabulary, a draft close to it, and two drafts a
    target must refuse (another tokenizer, another vocabulary)."""
    directory = tmp_path_factory.mktemp("speculative")
    target = write_test_checkpoint(directory / "target.pt")
    return {
        "target": directory / "target.pt",
        "draft": save(perturbed_copy(target, 0.1), directory / "draft.pt"),
        "r50k": save(perturbed_copy(target, 0.1), directory / "r50k.pt", "r50k_base"),
        "small_vocab": save(make_test_model(0), directory / "small_vocab.pt"),
    }


def run_json(capsys: pytest.CaptureFixture, *args: str | Path) -> list[int]:
    code = cli_generate.main(["--json", "--temperature", "0", *map(str, args)])
    out, err = capsys.readouterr()
    assert code == 0, err
    (line,) = out.splitlines()
    return json.loads(line)["token_ids"]


@pytest.mark.parametrize(
    "flags",
    [
        ["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--ngram-max", "2"],
        ["--speculative-method", "self:1", "--num-speculative-tokens", "5"],
        ["--speculative-model", "DRAFT", "--num-speculative-tokens", "8"],
    ],
    ids=["ngram", "self", "draft"],
)
@pytest.mark.slow
def test_cli_generate_equals_the_uncached_oracle(checkpoints, capsys, flags) -> None:
    common = ["--checkpoint-path", checkpoints["target"], "--prompt", PROMPT, "--max-new-tokens", "40"]  # fmt: skip
    want = run_json(capsys, *common, "--no-kv-cache")
    flags = [str(checkpoints["draft"]) if flag == "DRAFT" else flag for flag in flags]
    code = cli_generate.main(["--temperature", "0", *map(str, common), *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "[roseinfer] speculative decoding:" in err and "drafted tokens accepted" in err
    assert run_json(capsys, *common, *flags) == want


def test_a_sampled_run_is_told_it_gets_no_drafts_in_one_line(checkpoints, capsys) -> None:
    """At the default temperature (0.8) the engine drafts nothing (its documented limit):
    one line says so, and no 0/0 rate (nan) is printed."""
    flags = ["--speculative-method", "ngram", "--num-speculative-tokens", "4", "--seed", "1"]
    common = ["--checkpoint-path", str(checkpoints["target"]), "--prompt", PROMPT]
    code = cli_generate.main([*common, "--max-new-tokens", "8", *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    said = [line for line in err.splitlines() if "speculative decoding" in line]
    assert said == [
        "[roseinfer] speculative decoding: off: --temperature 0.8 samples, and the engine "
        "drafts for greedy requests only (temperature 0); a sampled request decodes one "
        "token a step, as without speculative decoding"
    ], err
    assert "nan" not in err.lower()


def test_no_step_with_a_draft_is_said_without_a_rate() -> None:
    """The summary of a greedy run whose drafter never proposed anything: no 0/0."""
    from roseinfer.cli.generator import speculative_summary
    from roseinfer.speculative.verify import SpeculativeStats

    assert speculative_summary(SpeculativeStats()) == (
        "no step had a draft to verify (0 tokens drafted)"
    )
    assert speculative_summary(SpeculativeStats(2, 6, 3)) == (
        "3/6 drafted tokens accepted (50.0%), 2.50 tokens per verify step (2 steps)"
    )


# The speculative flags (R50K, SMALL: the drafts of another tokenizer, another vocabulary)
# -> what the one line says.
BAD = {
    "--speculative-method ngram --num-speculative-tokens 0": "integer >= 1",
    "--speculative-method ngram --num-speculative-tokens 1024": "do not fit the target's "
    "context of 1024 tokens",
    "--speculative-method ngram": "needs --num-speculative-tokens",
    "--num-speculative-tokens 3": "needs --speculative-model or",
    "--speculative-method eagle --num-speculative-tokens 3": "ngram or self:N",
    "--speculative-method self:2 --num-speculative-tokens 3": "first 1 .. 1 layers",
    "--speculative-model no/such.pt --num-speculative-tokens 3": "draft model not found",
    "--speculative-model R50K --num-speculative-tokens 3": "share the target's tokenizer",
    "--speculative-model SMALL --num-speculative-tokens 3": "small_vocab.pt: tokenizer 'gpt2' "
    "has 50257 tokens but the model's vocabulary has 512",
    "--speculative-method ngram --num-speculative-tokens 3 --no-kv-cache": "speculative "
    "decoding runs in the engine",
}


@pytest.mark.parametrize("case", BAD)
def test_bad_speculative_flags_are_one_line_and_exit_2(checkpoints, capsys, case) -> None:
    drafts = {"R50K": checkpoints["r50k"], "SMALL": checkpoints["small_vocab"]}
    flags, message = [str(drafts.get(f, f)) for f in case.split()], BAD[case]
    code = cli_generate.main(["--checkpoint-path", str(checkpoints["target"]), *flags])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("[roseinfer] error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_llm_generate_with_every_draft_kind(checkpoints) -> None:
    tokenizer = Tokenizer("gpt2")
    target = LLM(str(checkpoints["target"])).engine.model
    prompts = [PROMPT, "ROMEO: O, she doth teach the torches to burn bright!"]
    params = SamplingParams(max_tokens=24)
    want = [
        generate(target, tokenizer.encode(p), params, use_cache=False).token_ids for p in prompts
    ]
    for speculative in (
        {"method": "ngram", "num_speculative_tokens": 4},
        {"method": "self", "self_layers": 1, "num_speculative_tokens": 2},
        {"method": "draft", "model": str(checkpoints["draft"]), "num_speculative_tokens": 6},
    ):
        llm = LLM(str(checkpoints["target"]), speculative=speculative)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outputs] == want, speculative
        stats = llm.engine.stats().speculative
        assert stats.num_draft_tokens > 0 and stats.mean_accepted_length >= 1
    with pytest.raises(RoseError, match="speculative:"):
        LLM(str(checkpoints["target"]), speculative={"method": "ngram"})


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"method": "self", "self_layers": "1"}, "self_layers must be an integer >= 1, got '1'"),
        ({"method": "self", "self_layers": 1.0}, "self_layers must be an integer >= 1, got 1.0"),
        ({"method": "ngram", "ngram_min": "1"}, "ngram_min must be an integer >= 1"),
        ({"method": "draft", "model": 5}, "a draft model's path is a string, got 5"),
        ({"method": "draft", "model": "d.pt", "self_layers": 3}, "self_layers is not a setting"),
        ({"method": "ngram", "model": None, "ngram_max": 3, "self_layers": 1}, "self_layers"),
    ],
)
def test_a_speculative_dict_with_a_wrong_field_is_refused_before_loading(fields, said) -> None:
    """LLM(speculative={...}) checks each field's type (a TypeError from deep inside was
    all a caller got) and refuses a field its method never reads (silently ignored before)."""
    with pytest.raises(RoseError, match=re.escape(said)):
        LLM("no/such/checkpoint.pt", speculative={"num_speculative_tokens": 4, **fields})


@pytest.mark.slow
def test_a_hugging_face_draft_for_a_hugging_face_target(hf_gpt2_dir: Path) -> None:
    """An HF GPT-2 directory as the draft (here the target's own weights: every draft
    accepted, each verify step makes k + 1 tokens)."""
    speculative = {"method": "draft", "model": str(hf_gpt2_dir), "num_speculative_tokens": 3}
    llm = LLM(str(hf_gpt2_dir), speculative=speculative)
    prompt = Tokenizer("gpt2").encode(PROMPT)
    params = SamplingParams(max_tokens=13)
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    assert output.token_ids == generate(llm.engine.model, prompt, params, use_cache=False).token_ids
    stats = llm.engine.stats().speculative
    assert stats.acceptance_rate == 1.0 and stats.mean_accepted_length == 4.0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["DRAFT", "ngram", "self:1"])
def test_the_server_speculates_and_counts_drafts_as_vllm_names_them(
    checkpoints, tmp_path: Path, method: str
) -> None:
    """Streamed and not, the served greedy text is the oracle's; the counters move."""
    target = LLM(str(checkpoints["target"])).engine.model
    tokenizer = Tokenizer("gpt2")
    which = ["--speculative-model", str(checkpoints["draft"])] if method == "DRAFT" else [
        "--speculative-method", method
    ]  # fmt: skip
    params = SamplingParams(max_tokens=30)
    text, _, _ = solo_text(target, tokenizer, tokenizer.encode(PROMPT), params)
    ask = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=30, temperature=0)
    flags = [*which, "--num-speculative-tokens", "4"]
    with running_server(checkpoints["target"], tmp_path / "log", *flags) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        assert client.completions.create(**ask).choices[0].text == text
        stream = client.completions.create(**ask, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream) == text
        after = wait_idle(server)
        live = httpx.get(server.url + "/live/snapshot").json()["speculative"]
        # A sampled request (the API's default temperature, 1) gets no drafts: the log
        # says so once, at the first one.
        told = "speculative decoding: a request with temperature 1.0 gets no drafts"
        assert told not in server.log()
        for _ in range(2):
            client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, seed=1)
        assert server.log().count(told) == 1, server.log()
        drafted_now = wait_idle(server)["rose_spec_decode_num_draft_tokens_total"]
        assert drafted_now == after["rose_spec_decode_num_draft_tokens_total"]
    drafted = after["rose_spec_decode_num_draft_tokens_total"]
    assert live["num_draft_tokens"] == drafted and live["acceptance_rate"] == pytest.approx(
        after["rose_spec_decode_num_accepted_tokens_total"] / drafted
    )
    accepted = after["rose_spec_decode_num_accepted_tokens_total"]
    assert after["rose_spec_decode_num_drafts_total"] > 0 and 0 <= accepted <= drafted
    if method == "DRAFT":  # (a draft close to the target: some drafts are kept)
        assert accepted > 0


def test_serve_refuses_bad_speculative_flags(checkpoints, capsys) -> None:
    from roseinfer.cli import serve

    argv = ["--checkpoint-path", str(checkpoints["target"]), "--port", "0"]
    assert (
        serve.main([*argv, "--speculative-model", "no/such.pt", "--num-speculative-tokens", "4"])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("[rose-serve] error: ")
        and "draft model not found" in err
        and "\n" not in err
    )


@pytest.mark.slow
def test_the_benchmark_runs_in_quick_mode(capsys) -> None:
    """Every table prints; every speculative single stream made the plain run's tokens."""
    from benchmarks import speculative as bench

    assert bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    sections = ("1. single stream", "2. over k", "3. the engine", "4. costs", "5. Hugging Face")
    for section in sections:
        assert section in out
    single = out.split("1. single stream")[1].split("2. over k")[0].splitlines()[2:]
    rows = [line.split() for line in single if line.strip()]
    assert len(rows) == 8 and all(cells[-1] == "True" for cells in rows), single
