"""One offline run in vLLM, for rose's tests and benchmarks: run by the python of vLLM's own
venv (.ci/vllm-venv), never rose's, so it imports vLLM and the standard library only.

    $ROSE_VLLM_PYTHON benchmarks/vllm_runner.py JOB.json RESULT.json

JOB.json says what to run:

    {"model": "hf/tiny",                   # a Hugging Face folder (rose-export-hf writes one)
     "engine_args": {"dtype": "float32"},  # keyword arguments of vllm.LLM
     "prompts": ["text", [464, 3290]],     # text (vLLM tokenizes it) or token ids
     "max_tokens": [16, 16],               # new tokens per prompt, end-of-text ignored
     "logprobs": 0,                        # with each token its log-probability (null: none)
     "warmup": true}                       # one short request first, outside the timing

and RESULT.json what came back: per prompt the prompt's and the output's token ids, the
text, and the chosen tokens' log-probabilities; and the seconds vLLM took to start (read
the folder, build its engine process, compile, allocate its KV cache) and to generate.
Greedy throughout (temperature 0). rose's side: benchmarks/vllm_venv.py, which sets the
environment vLLM's CPU build wants (threads bound, KV cache size) and runs this.

vLLM starts its engine in a process of its own, by spawning one that imports this file
again: the work runs only under `if __name__ == "__main__"`.
"""

import json
import sys
import time


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    started = time.perf_counter()
    llm = LLM(model=job["model"], seed=0, **job["engine_args"])
    startup_s = time.perf_counter() - started

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=job["logprobs"]
        )

    prompts = [
        TokensPrompt(prompt_token_ids=prompt) if isinstance(prompt, list) else prompt
        for prompt in job["prompts"]
    ]
    if job.get("warmup"):  # first calls pay one-off costs, as in rose's benchmarks
        llm.generate([TokensPrompt(prompt_token_ids=[0] * 8)], params(2), use_tqdm=False)
    started = time.perf_counter()
    outputs = llm.generate(prompts, [params(n) for n in job["max_tokens"]], use_tqdm=False)
    generate_s = time.perf_counter() - started

    results = []
    for output in outputs:
        completion = output.outputs[0]
        logprobs = None
        if completion.logprobs is not None:  # per step: {token id: Logprob}, the chosen among them
            logprobs = [
                step[token].logprob
                for step, token in zip(completion.logprobs, completion.token_ids, strict=True)
            ]
        results.append(
            {
                "prompt_token_ids": list(output.prompt_token_ids),
                "token_ids": list(completion.token_ids),
                "text": completion.text,
                "logprobs": logprobs,
            }
        )
    return {"startup_s": startup_s, "generate_s": generate_s, "outputs": results}


if __name__ == "__main__":
    job_path, result_path = sys.argv[1:]
    with open(job_path) as f:
        result = run(json.load(f))
    with open(result_path, "w") as f:
        json.dump(result, f)
