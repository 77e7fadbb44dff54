"""The serving engine: a paged KV cache, continuous batching, prefix caching.

Read it in this order: sequence.py, block_manager.py, ../cache/paged.py, scheduler.py,
model_runner.py, llm_engine.py, llm.py (config.py and outputs.py hold settings and
results).
"""

from roseinfer.engine.config import EngineConfig
from roseinfer.engine.llm import LLM
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine.outputs import (
    CompletionOutput,
    EngineStats,
    RequestOutput,
    RequestOutputKind,
    TokenLogprob,
)

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "RequestOutput",
    "RequestOutputKind",
    "TokenLogprob",
]
