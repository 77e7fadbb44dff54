"""Shared fixtures: where the offline files live (../shared next to the repo)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    return REPO_ROOT.parent / "shared"


@pytest.fixture(scope="session")
def tinyshakespeare_path(shared_dir: Path) -> Path:
    return shared_dir / "data" / "tinyshakespeare.txt"


@pytest.fixture(scope="session", autouse=True)
def tiktoken_cache(shared_dir: Path) -> Iterator[str]:
    """Let tiktoken find the GPT-2 BPE files offline (subprocesses inherit it too).

    Session-scoped so that module-scoped fixtures which tokenise already see it.
    """
    cache = os.environ.get("TIKTOKEN_CACHE_DIR") or str(shared_dir / "tiktoken_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_CACHE_DIR", cache)
        yield cache
