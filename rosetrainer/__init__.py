"""rosetrainer: one readable GPT-2 and a trainer for it.

`GPT`, `GPTConfig` and `TrainConfig` are imported on first use (PEP 562), so the parts
that need no torch (errors, the tokenizer) import without it: the onnxruntime
generation loop runs on numpy and onnxruntime alone.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rosetrainer.config import GPTConfig, TrainConfig
    from rosetrainer.model import GPT

__all__ = ["GPT", "GPTConfig", "TrainConfig"]
_HOMES = {
    "GPT": "rosetrainer.model",
    "GPTConfig": "rosetrainer.config",
    "TrainConfig": "rosetrainer.config",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'rosetrainer' has no attribute {name!r}")
