"""Chapter 03: the causal mask of q_len new queries over kv_len keys, bottom-right aligned."""

from __future__ import annotations

import torch


def causal_mask(q_len: int, kv_len: int, device: torch.device | None = None) -> torch.Tensor:
    # The new queries are the newest positions: the last q_len rows of the full triangle.
    full = torch.ones(kv_len, kv_len, dtype=torch.bool, device=device).tril()
    return full[kv_len - q_len :]
