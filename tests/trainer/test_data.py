"""Data preparation: the token files hold exactly tiktoken's ids, are cached, and batch right."""

from __future__ import annotations

import io
import subprocess
import sys
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch

import rosetrainer.data
from rosetrainer.data import (
    TINYSHAKESPEARE_SHA256,
    download_tinyshakespeare,
    get_batch,
    load_tokens,
    prepare_data,
    split_at_safe_points,
)
from rosetrainer.errors import RoseError

# Everything that tends to break chunked tokenisation: blank lines, lines of spaces,
# indentation, trailing spaces, tabs, Windows line ends, non-ASCII letters and emoji.
TRICKY_TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\n\n   \n"
    "    indented line\n\tTabbed line  \nNo break after this\r\n"
    "Windows line\r\n\r\nDouble Windows break\r\nx\n"
    "Über naïve café — 日本語のテキスト 😀 emoji\n \nspace-only line above\n"
    "'s 've 're contractions at a line start\n42 numbers\n...punctuation!\n"
)


@pytest.fixture(scope="module")
def gpt2() -> tiktoken.Encoding:
    return tiktoken.get_encoding("gpt2")


def all_tokens(prepared) -> np.ndarray:
    return np.concatenate([load_tokens(prepared.train_path), load_tokens(prepared.val_path)])


@pytest.fixture(scope="module")
def shakespeare(tinyshakespeare_path, tmp_path_factory):
    """TinyShakespeare prepared once for this module, tokenised by two worker processes."""
    return prepare_data(
        text_file=str(tinyshakespeare_path),
        data_dir=str(tmp_path_factory.mktemp("data")),
        num_proc=2,
    )


@pytest.mark.slow
def test_tinyshakespeare_tokens_equal_tiktoken_on_the_whole_text(
    shakespeare, tinyshakespeare_path, gpt2
):
    expected = gpt2.encode_ordinary(tinyshakespeare_path.read_bytes().decode("utf-8"))
    assert len(expected) == 338_025
    meta = shakespeare.meta
    assert meta["n_train_tokens"] + meta["n_val_tokens"] == len(expected)
    assert meta["n_train_tokens"] == int(len(expected) * 0.9)
    assert all_tokens(shakespeare).tolist() == expected
    assert (meta["tokenizer_name"], meta["eot_id"], meta["vocab_size"]) == ("gpt2", 50256, 50257)
    assert meta["source"] == str(tinyshakespeare_path)


def test_cutting_at_safe_points_keeps_the_tokens(gpt2):
    chunks = split_at_safe_points(TRICKY_TEXT, chunk_chars=8)
    assert len(chunks) > 5
    assert "".join(chunks) == TRICKY_TEXT
    pieces = [token for chunk in chunks for token in gpt2.encode_ordinary(chunk)]
    assert pieces == gpt2.encode_ordinary(TRICKY_TEXT)


def test_a_newline_after_whitespace_is_not_a_safe_point(gpt2):
    """Why SAFE_SPLIT wants non-whitespace before the "\\n": at the end of a text,
    tiktoken keeps a whitespace run together, so cutting after "\\n\\n" changes tokens."""
    whole = gpt2.encode_ordinary("Speak.\n\nAll:")
    assert gpt2.encode_ordinary("Speak.\n\n") + gpt2.encode_ordinary("All:") != whole
    assert split_at_safe_points("Speak.\n\nAll:", chunk_chars=1) == ["Speak.\n\nAll:"]
    assert gpt2.encode_ordinary("Speak.\n") + gpt2.encode_ordinary("All:") == gpt2.encode_ordinary(
        "Speak.\nAll:"
    )


@pytest.fixture
def tricky_file(tmp_path) -> Path:
    path = tmp_path / "tricky.txt"
    path.write_bytes(TRICKY_TEXT.encode("utf-8"))  # bytes: keep the "\r\n" as written
    return path


def test_local_text_file_in_many_chunks_equals_tiktoken(tricky_file, tmp_path, gpt2, monkeypatch):
    monkeypatch.setattr(rosetrainer.data, "CHUNK_CHARS", 16)  # many rows from a small text
    prepared = prepare_data(text_file=str(tricky_file), data_dir=str(tmp_path / "data"))
    assert all_tokens(prepared).tolist() == gpt2.encode_ordinary(TRICKY_TEXT)
    assert prepared.train_path.parent.name.startswith("tricky-")


def test_second_prepare_uses_the_cache(tricky_file, tmp_path, capsys):
    data_dir = str(tmp_path / "data")
    first = prepare_data(text_file=str(tricky_file), data_dir=data_dir)
    written = [p.stat().st_mtime_ns for p in (first.train_path, first.val_path)]
    capsys.readouterr()

    again = prepare_data(text_file=str(tricky_file), data_dir=data_dir)
    assert "cached" in capsys.readouterr().out
    assert again == first
    assert [p.stat().st_mtime_ns for p in (again.train_path, again.val_path)] == written

    other_split = prepare_data(text_file=str(tricky_file), data_dir=data_dir, val_fraction=0.5)
    assert other_split.train_path.parent != first.train_path.parent

    (first.train_path.parent / "meta.json").unlink()  # as if a prepare had been cut short
    capsys.readouterr()
    redone = prepare_data(text_file=str(tricky_file), data_dir=data_dir)
    assert "tokenising" in capsys.readouterr().out
    assert redone.meta == first.meta


def test_get_batch_gives_shifted_windows_deterministically(shakespeare):
    tokens = load_tokens(shakespeare.train_path)
    x, y = get_batch(tokens, 8, 64, torch.Generator().manual_seed(7))
    assert x.shape == y.shape == (8, 64) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert 0 <= int(x.min()) and int(y.max()) < 50257
    for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):  # windows of the real stream
        start = _find(tokens, row_x)
        assert row_y == tokens[start + 1 : start + 65].tolist()

    again = get_batch(tokens, 8, 64, torch.Generator().manual_seed(7))
    other = get_batch(tokens, 8, 64, torch.Generator().manual_seed(8))
    assert torch.equal(again[0], x) and torch.equal(again[1], y)
    assert not torch.equal(other[0], x)


def _find(tokens: np.ndarray, window: list[int]) -> int:
    starts = np.flatnonzero(tokens[: len(tokens) - len(window)] == window[0])
    return next(s for s in starts if tokens[s : s + len(window)].tolist() == window)


def test_a_split_too_short_for_one_window_says_how_short():
    tokens = np.arange(10, dtype=np.uint16)
    x, _ = get_batch(tokens, 2, 9, torch.Generator().manual_seed(0))
    assert x.shape == (2, 9)
    with pytest.raises(RoseError, match=r"of 10 tokens is too short .* \(it needs 11\)"):
        get_batch(tokens, 2, 10, torch.Generator().manual_seed(0))


def test_bad_text_files_and_token_files_give_clear_errors(tmp_path):
    data_dir = str(tmp_path / "data")
    with pytest.raises(RoseError, match="not found"):
        prepare_data(text_file=str(tmp_path / "nope.txt"), data_dir=data_dir)
    with pytest.raises(RoseError, match="text file /dev/null is not a regular file"):
        prepare_data(text_file="/dev/null", data_dir=data_dir)
    with pytest.raises(RoseError, match="is a directory"):
        prepare_data(text_file=str(tmp_path), data_dir=data_dir)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(RoseError, match="is empty"):
        prepare_data(text_file=str(tmp_path / "empty.txt"), data_dir=data_dir)
    (tmp_path / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    with pytest.raises(RoseError, match=r"not UTF-8 \(byte 3"):
        prepare_data(text_file=str(tmp_path / "latin1.txt"), data_dir=data_dir)
    with pytest.raises(RoseError, match="token file not found"):
        load_tokens(tmp_path / "train.bin")


def _fake_download(payload: bytes):
    def urlopen(url, timeout):
        assert url == rosetrainer.data.TINYSHAKESPEARE_URL
        return io.BytesIO(payload)

    return urlopen


def test_tinyshakespeare_download_is_checked_and_skipped_when_present(
    tmp_path, tinyshakespeare_path, monkeypatch
):
    real_text = tinyshakespeare_path.read_bytes()
    monkeypatch.setattr(rosetrainer.data.urllib.request, "urlopen", _fake_download(b"not it"))
    with pytest.raises(RoseError, match=f"expected {TINYSHAKESPEARE_SHA256}; it was not kept"):
        download_tinyshakespeare(tmp_path)
    assert not (tmp_path / "tinyshakespeare.txt").exists()

    monkeypatch.setattr(rosetrainer.data.urllib.request, "urlopen", _fake_download(real_text))
    path = download_tinyshakespeare(tmp_path)
    assert path == tmp_path / "tinyshakespeare.txt" and path.read_bytes() == real_text

    def offline(url, timeout):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(rosetrainer.data.urllib.request, "urlopen", offline)
    assert download_tinyshakespeare(tmp_path) == path  # there and intact: no download
    with pytest.raises(
        RoseError, match="pass --text-file PATH .* or put TinyShakespeare.s input.txt at .*other"
    ):
        download_tinyshakespeare(tmp_path / "other")


def test_hugging_face_dataset_documents_each_end_with_eot(tmp_path, gpt2, monkeypatch):
    """A local folder of .txt files is a dataset `load_dataset` reads offline: one row a line."""
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "lines.txt").write_text("first document\nsecond one, longer\nthird\n")
    prepared = prepare_data(dataset=str(corpus), data_dir=str(tmp_path / "data"))
    eot = [gpt2.eot_token]
    expected = sum(
        (gpt2.encode_ordinary(d) + eot for d in ("first document", "second one, longer", "third")),
        [],
    )
    assert all_tokens(prepared).tolist() == expected
    assert prepared.meta["source"] == f"hf:{corpus}"

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(RoseError, match="offline\\? pass --text-file PATH"):
        prepare_data(dataset="nobody/no-such-dataset", data_dir=str(tmp_path / "data"))


@pytest.mark.slow
def test_cli_bad_path_is_one_line_and_exit_2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "rosetrainer.data", "--text-file", str(tmp_path / "missing.txt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("[rosetrainer.data] error: text file ")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
