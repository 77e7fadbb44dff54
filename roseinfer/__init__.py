"""roseinfer: generation with a KV cache, grown step by step and checked against the oracle.

`roseinfer.LLM`, `roseinfer.SamplingParams` and `roseinfer.StructuredOutputs` are the
offline engine's front door (imported on first use, so the other modules start without
the engine).
"""

from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "StructuredOutputs"]


def __getattr__(name: str) -> object:
    if name == "LLM":
        from roseinfer.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from roseinfer.request.sampling import SamplingParams

        return SamplingParams
    if name == "StructuredOutputs":
        from roseinfer.request.sampling_params import StructuredOutputs

        return StructuredOutputs
    raise AttributeError(f"module 'roseinfer' has no attribute {name!r}")
