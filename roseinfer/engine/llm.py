"""`LLM`: offline generation for many prompts through the engine, in one call.

from roseinfer import LLM, SamplingParams
llm = LLM("checkpoints/run")                      # a .pt, a run directory, or an HF directory
                                                  # (on CUDA when there is a GPU: device="cpu" to choose)
outputs = llm.generate(["ROMEO:", "JULIET:"], SamplingParams(max_tokens=32))
print(outputs[0].outputs[0].text)                 # vLLM's shape (outputs[0].text: the same)
"""

from __future__ import annotations

import sys
import threading
from dataclasses import replace
from numbers import Integral
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
from rosetrainer.threads import Threads
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
        num_threads: int | None = None,
        **engine_config: object,
    ) -> None:
        """model: a rose .pt, a run directory, or a Hugging Face GPT-2 directory (hf=None
        tells them apart by its config.json); None takes the newest checkpoint.
        num_threads: CPU threads for PyTorch, fixed (None: OMP_NUM_THREADS if set, else
        auto: one per core, fewer while other programs keep the cores busy; rosetrainer/threads.py).
        device: "auto" (CUDA when there is a GPU, else the CPU; one line on stderr says
        which), "cpu", "cuda" or "cuda:N" (CUDA asked for where there is none: a RoseError).
        speculative: speculative decoding, a SpeculativeConfig or its fields as a dict, e.g.
        {"method": "ngram", "num_speculative_tokens": 4} or {"method": "draft", "model":
        "checkpoints/small", "num_speculative_tokens": 4}.
        engine_config: EngineConfig's fields (kv_block_size, num_kv_blocks, kv_cache_memory,
        max_num_seqs, max_num_batched_tokens, enable_prefix_caching, ...)."""
        self.threads = Threads(num_threads)
        self.lock = threading.Lock()  # one generate at a time (the engine is not thread-safe)
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
        llm.threads = Threads()
        llm.lock = threading.Lock()
        spec = as_speculative_config(speculative)
        config = EngineConfig(**engine_config)
        llm.engine = speculative_engine(model, tokenizer, config, spec, draft_model)
        return llm

    def get_tokenizer(self) -> Tokenizer:
        """The tokenizer the engine encodes and decodes with (vLLM's name)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in the prompts' order, read as vLLM's are
        (`outputs[i].outputs[0].text`, `.token_ids`, `.finish_reason`) or as rose's
        (`outputs[i].text`; see roseinfer/engine/outputs.py). A prompt is text, token ids,
        or vLLM's dicts {"prompt": text} and {"prompt_token_ids": ids}.

        A request whose prompt and max_tokens do not fit the context stops when the context
        is full (finish_reason "length"), as vLLM's offline LLM stops at max_model_len;
        rose-serve refuses such a request with a 400, as vLLM's server does. Calls from
        several threads run one after the other (the engine steps one batch at a time)."""
        one = not isinstance(prompts, (list, tuple)) or (prompts and isinstance(prompts[0], int))
        prompts = [as_prompt(prompt) for prompt in ([prompts] if one else prompts)]
        params = SamplingParams() if sampling_params is None else sampling_params
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise RoseError(
                f"{len(params)} SamplingParams for {len(prompts)} prompt(s): "
                f"give one, or one per prompt"
            )
        with self.lock:
            return self._generate(prompts, params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role": ..., "content": ...}
        messages) or a list of them, each rendered into one prompt by the chat template,
        then generated as `generate` does. The template (Jinja2 source): `chat_template`,
        else the model folder's own (a Llama's or Qwen's tokenizer_config.json), else
        rose-serve's default (each message on its own paragraph, "Assistant:" last); so the
        prompt is the one rose-serve's /v1/chat/completions makes of the same messages."""
        try:  # (rose[serve]'s: the server renders its chats with the same code)
            from roseinfer.serving.chat_template import (
                DEFAULT_CHAT_TEMPLATE,
                ChatTemplate,
                ChatTemplateFailed,
            )
        except ImportError as err:
            raise RoseError(
                f"LLM.chat renders with jinja2 ({err}): pip install 'rose[serve]'"
            ) from None
        one = all(isinstance(m, dict) for m in messages)  # ([] too: no messages at all)
        conversations = [messages] if one else messages
        for i, conversation in enumerate(conversations):
            if not conversation or not all(is_message(m) for m in conversation):
                raise RoseError(
                    f"LLM.chat: conversation {i} is not a non-empty list of messages, each a "
                    f'dict with string "role" and "content" (got {conversation!r:.80})'
                )
        source = chat_template or self.engine.tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE
        template = ChatTemplate(source)
        try:
            prompts = [template.render(conversation) for conversation in conversations]
        except ChatTemplateFailed as err:
            raise RoseError(str(err)) from None
        return self.generate(prompts, sampling_params, use_tqdm)

    def _generate(
        self, prompts: list[str | list[int]], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.engine
        # Only the finished outputs are returned: the engine makes no other.
        final_only = RequestOutputKind.FINAL_ONLY
        # A prompt's n completions are n requests, choice i with seed + i (as rose-serve
        # draws a request's n choices): ids[k] lists prompt k's, its own first.
        ids = [
            [engine.add_request(prompt, choice, output_kind=final_only) for choice in p.choices()]
            for prompt, p in zip(prompts, params, strict=True)
        ]
        total = sum(len(choices) for choices in ids)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=total, desc="generating", unit="request", disable=not use_tqdm) as bar:
            self.threads.adapt()  # (between steps too: the machine's load may change)
            for output in engine.drain(after_step=self.threads.adapt):
                finished[output.request_id] = output
                bar.update(1)
        results = []
        for prompt, (first, *more) in zip(prompts, ids, strict=True):
            output = finished[first]
            if isinstance(prompt, str):
                output.prompt = prompt
            for index, request_id in enumerate(more, start=1):
                (completion,) = finished[request_id].outputs
                output.more_completions.append(replace(completion, index=index))
            results.append(output)
        return results


def is_message(message: object) -> bool:
    """A chat message as LLM.chat takes it: {"role": str, "content": str, ...}."""
    return (
        isinstance(message, dict)
        and isinstance(message.get("role"), str)
        and isinstance(message.get("content"), str)
    )


# A prompt as LLM.generate takes it: text, token ids, or vLLM's TextPrompt / TokensPrompt.
Prompt = str | list[int] | dict


def as_prompt(prompt: Prompt) -> str | list[int]:
    """Text or token ids, from any of the prompt forms `LLM.generate` takes."""
    if isinstance(prompt, dict):
        if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
        if set(prompt) == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], list):
            return prompt["prompt_token_ids"]
        raise RoseError(
            f"a prompt given as a dict is {{'prompt': text}} or {{'prompt_token_ids': ids}} "
            f"(vLLM's TextPrompt and TokensPrompt), got the keys {sorted(prompt)}"
        )
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and all(isinstance(t, Integral) for t in prompt)  # numpy's too
    ):
        return prompt
    raise RoseError(
        f"a prompt is text, token ids (a list of ints) or a dict {{'prompt': text}} / "
        f"{{'prompt_token_ids': ids}}, got {type(prompt).__name__} {str(prompt)[:40]}"
    )


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
