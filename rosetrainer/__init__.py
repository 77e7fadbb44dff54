"""rosetrainer: one readable GPT-2 and a trainer for it."""

from rosetrainer.config import GPTConfig, TrainConfig
from rosetrainer.model import GPT

__all__ = ["GPT", "GPTConfig", "TrainConfig"]
