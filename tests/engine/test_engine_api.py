"""The engine's front doors: roseinfer.LLM (offline) and cli_generate with many prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from models import make_test_model

import roseinfer
from roseinfer.cli import generate as cli_generate
from roseinfer.loops.generate import generate
from roseinfer.request.sampling import SamplingParams
from rosetrainer.checkpoint import save_checkpoint
from rosetrainer.errors import RoseError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["ROMEO:", "", "What light", "Is the sun, and Juliet", "O"] * 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A strong-oracle model with GPT-2's vocabulary, saved as the trainer saves."""
    model = make_test_model(4, block_size=64, vocab_size=50257)
    path = tmp_path_factory.mktemp("engine") / "model.pt"
    state = {"model": model.state_dict(), "model_config": model.config.to_dict()}
    save_checkpoint(path, {**state, "tokenizer_name": "gpt2"})
    return path


def solo_ids(llm, prompt: str, params: SamplingParams) -> list[int]:
    tokenizer = llm.engine.tokenizer
    ids = tokenizer.encode(prompt) or [tokenizer.eot_id]
    model = llm.engine.model
    return generate(model, ids, params, use_cache=False, eot_id=tokenizer.eot_id).token_ids


def test_llm_generates_in_prompt_order_with_per_prompt_params(checkpoint: Path) -> None:
    llm = roseinfer.LLM(str(checkpoint), kv_block_size=4, max_num_batched_tokens=8)
    params = [
        roseinfer.SamplingParams(max_tokens=3 + i % 4, temperature=0.8 * (i % 2), seed=i)
        for i in range(len(PROMPTS))
    ]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [
        llm.engine.tokenizer.encode(p) or [llm.engine.tokenizer.eot_id] for p in PROMPTS
    ]
    for prompt, p, output in zip(PROMPTS, params, outputs, strict=True):
        assert output.finished and output.finish_reason in ("stop", "length")
        assert output.token_ids == solo_ids(llm, prompt, p)
        assert output.text == llm.engine.tokenizer.decode(output.token_ids)
    # The repeated prompts came from the prefix cache the second time.
    assert llm.engine.stats().prefix_cache_hits > 0


def test_llm_outputs_read_as_vllms_so_its_offline_example_runs_unchanged(
    checkpoint: Path, capsys: pytest.CaptureFixture
) -> None:
    """vLLM's offline quickstart, its loop verbatim (from vllm import LLM -> roseinfer):
    each output's prompt, request id and completion (outputs[0]) as vLLM names them,
    the same tokens and text as rose's own fields, the oracle's tokens."""
    from roseinfer import LLM, SamplingParams

    prompts = ["Hello, my name is", "The president of the United States is"]
    sampling_params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)
    llm = LLM(model=str(checkpoint), dtype="float32")
    outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        f"Prompt: {p!r}, Generated text: {o.text!r}" for p, o in zip(prompts, outputs, strict=True)
    ]
    tokenizer = llm.engine.tokenizer
    for prompt, output in zip(prompts, outputs, strict=True):
        [completion] = output.outputs
        assert output.finished and completion.finished() and completion.index == 0
        assert output.request_id and output.prompt_token_ids == tokenizer.encode(prompt)
        assert completion.token_ids == solo_ids(llm, prompt, sampling_params)
        assert completion.text == tokenizer.decode(completion.token_ids)
        assert completion.finish_reason == output.finish_reason == "length"
        assert completion.logprobs == output.logprobs and len(completion.logprobs) == 6
        assert completion.cumulative_logprob == pytest.approx(
            sum(lp.logprob for lp in output.logprobs)
        )
    (by_ids,) = llm.generate([tokenizer.encode(prompts[0])], sampling_params, use_tqdm=False)
    assert by_ids.prompt is None  # (given as ids: vLLM's prompt is None too)
    assert by_ids.outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_llm_takes_vllms_prompt_dicts_keywords_and_top_k_off(checkpoint: Path) -> None:
    """What vLLM's offline examples spell differently: TextPrompt / TokensPrompt dicts, the
    sampling_params keyword, top_k=-1 for off, get_tokenizer()."""
    from roseinfer import LLM, SamplingParams

    llm = LLM(model=str(checkpoint))
    greedy = SamplingParams(temperature=0.0, max_tokens=5, top_k=-1)
    assert greedy.top_k == 0  # (vLLM's off, stored as rose's)
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("What light")
    outputs = llm.generate(
        [{"prompt": "What light"}, {"prompt_token_ids": ids}], sampling_params=greedy,
        use_tqdm=False,
    )  # fmt: skip
    want = solo_ids(llm, "What light", greedy)
    assert [o.outputs[0].token_ids for o in outputs] == [want, want]
    assert outputs[0].prompt == "What light" and outputs[1].prompt is None
    (alone,) = llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)
    assert alone.outputs[0].token_ids == want
    with pytest.raises(RoseError, match="TextPrompt and TokensPrompt"):
        llm.generate({"text": "What light"}, greedy, use_tqdm=False)


def test_llm_makes_n_completions_a_prompt_as_vllm_does(checkpoint: Path) -> None:
    """SamplingParams(n=3): each prompt's output holds three completions (outputs[0..2],
    index 0..2); choice i is the one-completion request seeded seed + i (as rose-serve
    draws a request's n choices), its uncached tokens; the engine itself takes one
    completion a request, and says where n goes."""
    llm = roseinfer.LLM(str(checkpoint), kv_block_size=4)
    sampled = SamplingParams(max_tokens=6, temperature=1.5, seed=11, n=3)
    outputs = llm.generate(["What light", "O"], sampled, use_tqdm=False)
    for prompt, output in zip(["What light", "O"], outputs, strict=True):
        assert [c.index for c in output.outputs] == [0, 1, 2]
        assert output.text == output.outputs[0].text
        for i, completion in enumerate(output.outputs):
            one = SamplingParams(max_tokens=6, temperature=1.5, seed=11 + i)
            assert completion.token_ids == solo_ids(llm, prompt, one)
            assert completion.finish_reason in ("stop", "length")
        assert len({tuple(c.token_ids) for c in output.outputs}) > 1  # (seeds differ)
    assert not llm.engine.has_unfinished()
    with pytest.raises(RoseError, match="add_request runs one completion, got n=3"):
        llm.engine.add_request("O", sampled)
    with pytest.raises(RoseError, match="n must be an integer >= 1, got 0"):
        SamplingParams(n=0)


def test_llm_called_from_several_threads_runs_each_call_whole(checkpoint: Path) -> None:
    """The engine is not thread-safe: LLM.generate calls from several threads run one after
    the other, each with its oracle tokens, and the LLM still works after."""
    import threading

    llm = roseinfer.LLM(str(checkpoint))
    greedy = roseinfer.SamplingParams(temperature=0.0, max_tokens=6)
    results: dict[int, list[int]] = {}

    def call(i: int) -> None:
        (output,) = llm.generate([PROMPTS[i]], greedy, use_tqdm=False)
        results[i] = output.token_ids

    callers = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert results == {i: solo_ids(llm, PROMPTS[i], greedy) for i in range(4)}
    assert not llm.engine.has_unfinished()


def test_llm_chat_renders_each_conversation_as_rose_serve_does_then_generates(
    checkpoint: Path,
) -> None:
    """vLLM's LLM.chat: one conversation or a list of them, each rendered by the chat
    template (here rose-serve's default: GPT-2 has no chat format) into the prompt the
    server's /v1/chat/completions makes, then decoded as generate decodes that prompt."""
    from roseinfer.serving.chat_template import ChatTemplate

    llm = roseinfer.LLM(str(checkpoint), kv_block_size=4)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    talks = [
        [{"role": "user", "content": "Who is Romeo?"}],
        [
            {"role": "system", "content": "Speak as Juliet."},
            {"role": "user", "content": "What light through yonder window breaks?"},
        ],
    ]
    prompts = [ChatTemplate().render(talk) for talk in talks]
    assert prompts[0] == "User: Who is Romeo?\n\nAssistant:"
    outputs = llm.chat(talks, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.prompt_token_ids == llm.engine.tokenizer.encode(prompt)
        assert output.outputs[0].token_ids == solo_ids(llm, prompt, params)
    # One conversation (a list of messages, not of conversations): one output.
    (alone,) = llm.chat(talks[1], params, use_tqdm=False)
    assert alone.outputs[0].token_ids == outputs[1].outputs[0].token_ids
    # A template of the caller's own.
    (own,) = llm.chat(
        talks[0], params, use_tqdm=False, chat_template="{{ messages[-1].content }} ->"
    )
    assert own.prompt == "Who is Romeo? ->"


@pytest.mark.parametrize(
    "messages",
    [[], [[]], [{"role": "user"}], [{"role": "user", "content": 3}], ["Who is Romeo?"]],
)
def test_llm_chat_refuses_what_is_not_a_conversation_in_one_line(
    checkpoint: Path, messages: list
) -> None:
    llm = roseinfer.LLM(str(checkpoint), kv_block_size=4)
    with pytest.raises(RoseError, match="not a non-empty list of messages") as err:
        llm.chat(messages, use_tqdm=False)
    assert "\n" not in str(err.value)
    assert llm.engine.stats().num_running == 0 and not llm.engine.has_unfinished()


def test_drain_yields_each_request_once_and_runs_what_a_step_adds(checkpoint: Path) -> None:
    """The engine's one drain loop: every request's last output, once, as it finishes; a
    request added after a step (after_step) is run too."""
    engine = roseinfer.LLM(str(checkpoint), kv_block_size=4).engine
    params = roseinfer.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = engine.add_request("ROMEO:", params)
    later: list[str] = []

    def after_step() -> None:
        if not later:
            later.append(engine.add_request("O", params))

    outputs = list(engine.drain(after_step))
    assert sorted(o.request_id for o in outputs) == sorted([first, *later])
    assert all(o.finished and len(o.token_ids) == 4 for o in outputs)
    assert not engine.has_unfinished() and list(engine.drain()) == []


def test_llm_loads_a_hugging_face_directory(hf_gpt2_dir: Path) -> None:
    llm = roseinfer.LLM(str(hf_gpt2_dir))
    (output,) = llm.generate("Hello", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert output.token_ids == solo_ids(llm, "Hello", SamplingParams(max_tokens=4, ignore_eos=True))


def test_llm_runs_where_auto_points_and_says_so(
    checkpoint: Path, capsys: pytest.CaptureFixture
) -> None:
    """LLM's default device is "auto": CUDA where there is one, here the CPU, said in one
    line; CUDA asked for where there is none is one clear error, before anything loads."""
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    llm = roseinfer.LLM(str(checkpoint))
    assert str(next(llm.engine.model.parameters()).device) == expected
    assert capsys.readouterr().err == f"[rose] LLM on {expected.split(':')[0]} (device='auto')\n"
    if not torch.cuda.is_available():
        with pytest.raises(RoseError, match="--device cuda, but CUDA is not available here"):
            roseinfer.LLM(str(checkpoint), device="cuda")


def test_llm_rejects_a_mismatched_params_list(checkpoint: Path) -> None:
    llm = roseinfer.LLM(str(checkpoint))
    with pytest.raises(RoseError, match="2 SamplingParams for 3 prompt"):
        llm.generate(["a", "b", "c"], [SamplingParams()] * 2, use_tqdm=False)
    # (a number or a list of floats was a TypeError from deep inside, not what to give)
    for wrong in (5, [5.0], [[1, 2.5]], ["a", None]):
        with pytest.raises(RoseError, match=r"a prompt is text, token ids \(a list of ints\)"):
            llm.generate(wrong, use_tqdm=False)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    code = cli_generate.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
def test_cli_prompt_file_runs_through_the_engine_in_order(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    lines = [f"{PROMPTS[i % len(PROMPTS)] or 'x'} {i}" for i in range(40)]
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    common = ["--checkpoint-path", str(checkpoint), "--prompt-file", str(prompt_file)]
    common += ["--max-new-tokens", "6", "--seed", "3", "--json", "--device", "cpu"]
    code, engine_out, engine_err = run_cli([*common, "--max-num-seqs", "8"], capsys)
    assert code == 0, engine_err
    assert "kv cache: paged (engine)" in engine_err
    code, static_out, static_err = run_cli([*common, "--cache", "static"], capsys)
    assert code == 0 and "kv cache: static" in static_err
    engine_rows = [json.loads(line) for line in engine_out.splitlines()]
    static_rows = [json.loads(line) for line in static_out.splitlines()]
    assert [row["prompt"] for row in engine_rows] == lines
    assert [set(row) for row in engine_rows] == [set(row) for row in static_rows]
    # Same seed, same sampled tokens, whichever path ran them.
    assert [r["token_ids"] for r in engine_rows] == [r["token_ids"] for r in static_rows]


def test_cli_engine_flags_are_checked(checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["--checkpoint-path", str(checkpoint), "--prompt", "a", "--prompt", "b"]
    code, _, err = run_cli([*argv, "--kv-cache-memory", "lots"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--kv-cache-memory must be" in err
    code, _, err = run_cli([*argv, "--num-kv-blocks", "1", "--max-new-tokens", "40"], capsys)
    assert code == 2 and err.strip().endswith("give the pool more memory"), err


def test_engine_reports_time_and_memory_figures(checkpoint: Path) -> None:
    llm = roseinfer.LLM(str(checkpoint), num_kv_blocks=12, kv_block_size=8)
    (output,) = llm.generate(["abc"], SamplingParams(max_tokens=5), use_tqdm=False)
    assert output.arrival_time <= output.first_token_time <= output.finish_time
    assert llm.engine.pool.nbytes == 12 * 8 * 2 * 2 * 32 * torch.float32.itemsize


def test_bench_engine_on_cuda_where_there_is_none_is_one_line(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import engine as bench_engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_engine.main(["--quick", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda, but CUDA is not available here" in err


@pytest.mark.slow
def test_bench_engine_quick_runs_every_path_with_the_same_tokens(
    capsys: pytest.CaptureFixture,
) -> None:
    from benchmarks import engine as bench_engine

    code = bench_engine.main(["--quick"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = {
        line.split("  ")[0]: line
        for line in out.splitlines()
        if line.startswith(("one by one", "static batches", "engine ", "transformers"))
    }
    assert len(rows) == 6, out  # (one by one and static batches also with packed weights)
    assert "the engine against the packed-weight paths" in out
    assert all(row.endswith("8/8") for row in rows.values()), out  # equal tokens everywhere
    assert "KV bytes held per live token" in out
    off, on = (line for line in out.splitlines() if "prefix cache o" in line)
    prefilled = [int(line.split("prefilled ")[1].split(",")[0]) for line in (off, on)]
    assert prefilled[1] < prefilled[0]
    assert "same tokens with and without: True" in out
    # The decode floor: the in-place kernel with packed and plain weights, and the gather
    # one, at 2 and 4 running sequences, each step beside a positive floor (the bytes it
    # reads over the bandwidth measured), and the serial floor, never below it.
    floor = [line.split() for line in out.split("decode floor:")[1].splitlines()[2:]]
    assert [tuple(row[:3]) for row in floor] == [
        (n, attention, weights)
        for n in ("2", "4")
        for attention, weights in (("kernel", "packed"), ("kernel", "plain"), ("gather", "plain"))
    ], out
    for row in floor:
        step_ms, byte_floor_ms, flop_floor_ms = float(row[3]), float(row[6]), float(row[8])
        times_floor, serial_ms, times_serial = float(row[10][:-1]), float(row[11]), row[13]
        assert step_ms > 0 and byte_floor_ms > 0
        assert times_floor == pytest.approx(step_ms / max(byte_floor_ms, flop_floor_ms), rel=0.25)
        assert serial_ms >= max(byte_floor_ms, flop_floor_ms) - 0.05  # (printed to 0.1 ms)
        assert float(times_serial[:-1]) == pytest.approx(step_ms / serial_ms, rel=0.25)
