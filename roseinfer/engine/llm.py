"""`LLM`: offline generation for many prompts through the engine, in one call.

from roseinfer import LLM, SamplingParams
llm = LLM("checkpoints/run")                      # a .pt, a run directory, or an HF directory
                                                  # (on CUDA when there is a GPU: device="cpu" to choose)
outputs = llm.generate(["ROMEO:", "JULIET:"], SamplingParams(max_tokens=32))
print(outputs[0].text)
"""

from __future__ import annotations

import sys
from pathlib import Path

from tqdm.auto import tqdm

from roseinfer.engine.config import EngineConfig
from roseinfer.engine.llm_engine import speculative_engine
from roseinfer.engine.outputs import RequestOutput, RequestOutputKind
from roseinfer.loading import load_model_and_tokenizer
from roseinfer.request.sampling import SamplingParams
from roseinfer.speculative.drafters import SpeculativeConfig
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT
from rosetrainer.runtime import pick_device, pick_dtype
from rosetrainer.tokenizer import Tokenizer


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        hf: bool | None = None,
        device: str = "auto",
        dtype: str = "float32",
        tokenizer: str | None = None,
        speculative: SpeculativeConfig | dict | None = None,
        **engine_config: object,
    ) -> None:
        """model: a rose .pt, a run directory, or a Hugging Face GPT-2 directory (hf=None
        tells them apart by its config.json); None takes the newest checkpoint.
        device: "auto" (CUDA when there is a GPU, else the CPU; one line on stderr says
        which), "cpu", "cuda" or "cuda:N" (CUDA asked for where there is none: a RoseError).
        speculative: speculative decoding, a SpeculativeConfig or its fields as a dict, e.g.
        {"method": "ngram", "num_speculative_tokens": 4} or {"method": "draft", "model":
        "checkpoints/small", "num_speculative_tokens": 4}.
        engine_config: EngineConfig's fields (kv_block_size, num_kv_blocks, kv_cache_memory,
        max_num_seqs, max_num_batched_tokens, enable_prefix_caching, ...)."""
        spec = as_speculative_config(speculative)
        if hf is None:
            hf = model is not None and (Path(model) / "config.json").is_file()
        torch_device = pick_device(device)
        print(f"[rose] LLM on {torch_device} (device={device!r})", file=sys.stderr)
        gpt, tok, self.source = load_model_and_tokenizer(
            None if hf else model,
            model if hf else None,
            tokenizer,
            torch_device,
            pick_dtype(dtype, torch_device),
        )
        self.engine = speculative_engine(gpt, tok, EngineConfig(**engine_config), spec)

    @classmethod
    def from_model(
        cls,
        model: GPT,
        tokenizer: Tokenizer,
        speculative: SpeculativeConfig | dict | None = None,
        draft_model: GPT | None = None,
        **engine_config: object,
    ) -> LLM:
        """An LLM around a model already in memory (tests, chapters); draft_model: the
        draft of a speculative method "draft", in memory too (sharing the tokenizer)."""
        llm = cls.__new__(cls)
        llm.source = "in memory"
        spec = as_speculative_config(speculative)
        config = EngineConfig(**engine_config)
        llm.engine = speculative_engine(model, tokenizer, config, spec, draft_model)
        return llm

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in the prompts' order.

        A request whose prompt and max_tokens do not fit the context stops when the context
        is full (finish_reason "length"), as vLLM's offline LLM stops at max_model_len;
        rose-serve refuses such a request with a 400, as vLLM's server does."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = SamplingParams() if params is None else params
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise RoseError(
                f"{len(params)} SamplingParams for {len(prompts)} prompt(s): "
                f"give one, or one per prompt"
            )
        engine = self.engine
        # Only the finished outputs are returned: the engine makes no other.
        final_only = RequestOutputKind.FINAL_ONLY
        ids = [
            engine.add_request(prompt, p, output_kind=final_only)
            for prompt, p in zip(prompts, params, strict=True)
        ]
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="prompt", disable=not use_tqdm) as bar:
            for output in engine.drain():
                finished[output.request_id] = output
                bar.update(1)
        return [finished[request_id] for request_id in ids]


def as_speculative_config(speculative: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
    if speculative is None or isinstance(speculative, SpeculativeConfig):
        return speculative
    if not isinstance(speculative, dict):
        raise RoseError(
            f"speculative is a SpeculativeConfig or a dict of its fields, got "
            f"{type(speculative).__name__}"
        )
    try:
        config = SpeculativeConfig(**speculative)
    except TypeError as error:  # an unknown or missing field
        raise RoseError(f"speculative: {error}") from None
    unread = sorted(set(speculative) - SpeculativeConfig.fields_of(config.method))
    if unread:  # (given, then silently never read: a mistake the caller should hear of)
        raise RoseError(
            f"speculative: {', '.join(unread)} is not a setting of method {config.method!r}"
        )
    return config
