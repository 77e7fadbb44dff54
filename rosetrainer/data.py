"""Text -> uint16 token files (train.bin, val.bin), and random training batches from them.

`prepare_data` tokenises once and caches the result in a folder named after the
text and a hash of (text, tokenizer, val_fraction); a second call finds it and
returns at once. The text goes through Hugging Face `datasets`, so tokenising a
large corpus can use every core:

* a local text file (or TinyShakespeare, downloaded on first use) is cut into
  chunks at points where cutting cannot change the tokens, one chunk per row;
* a Hugging Face dataset (online only) gives one document per row, and each
  document is followed by the end-of-text token.

The first (1 - val_fraction) of the token stream is the training split, the rest
the validation split. `python -m rosetrainer.data` does the same from the shell.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rosetrainer.errors import (
    ArgumentParser,
    RoseError,
    not_a_file,
    one_line,
    os_error_line,
    run_cli,
)
from rosetrainer.files import ensure_writable_dir, write_bytes_atomically
from rosetrainer.tokenizer import Tokenizer, get_encoding

# `datasets` (and pandas, pyarrow behind it) is imported only when text is tokenised, not
# for a run whose tokens are already cached: seconds off every start.
if TYPE_CHECKING:
    from datasets import Dataset

TINYSHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
TINYSHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"

TOKEN_DTYPE = np.dtype(np.uint16)  # 2 bytes a token: GPT-2's 50,257 ids fit, and files stay small
CHUNK_CHARS = 1 << 16  # about how much text one row of the dataset holds
ROWS_PER_PROCESS = (
    64  # fewer rows than this per worker and starting workers costs more than it saves
)

# Where a text may be cut without changing its GPT-2 tokens: at a lone "\n" with
# non-whitespace on both sides. GPT-2's pre-tokenizer splits text into pieces by a
# regex, and no piece crosses such a "\n"; the "\n" is a piece of its own whether the
# text goes on or ends there. A "\n" after other whitespace is NOT such a point: at the
# very end of a text the regex keeps a whole whitespace run together, so a chunk ending
# in "\n\n" would give one "\n\n" token where the whole text gives "\n", "\n". With
# Windows line ends the same holds between "\r" and "\n" (in "x\r\ny").
SAFE_SPLIT = re.compile(r"(?<=\S\n)(?=\S)|(?<=\S\r)(?=\n\S)")


@dataclass
class PreparedData:
    train_path: Path
    val_path: Path
    meta: dict[str, Any]  # n_train_tokens, n_val_tokens, tokenizer_name, source, eot_id, vocab_size


def prepare_data(
    *,
    text_file: str | None = None,
    dataset: str = "tinyshakespeare",
    data_dir: str = "data",
    tokenizer_name: str = "gpt2",
    val_fraction: float = 0.1,
    num_proc: int | None = None,
) -> PreparedData:
    """Tokenise a text file or dataset into data_dir/<name>-<hash>/{train,val}.bin (cached)."""
    tokenizer = _checked_settings(tokenizer_name, val_fraction, num_proc)
    data_dir = Path(data_dir)

    from_hub = text_file is None and dataset != "tinyshakespeare"
    if from_hub:
        documents = _load_hf_dataset(dataset)
        # datasets' own hash of the loaded split's content stands in for the text's bytes.
        name, content, source = Path(dataset).name, documents._fingerprint.encode(), f"hf:{dataset}"
    else:
        path = Path(text_file) if text_file is not None else download_tinyshakespeare(data_dir)
        content, text = _read_text(path)
        name, source = path.stem, str(path)

    key = hashlib.sha256(content + f"|{tokenizer_name}|{val_fraction!r}".encode()).hexdigest()
    out_dir = data_dir / f"{name}-{key[:12]}"
    prepared = _cached(out_dir, key)
    if prepared is not None:
        print(f"[rosetrainer.data] cached: {out_dir} (already tokenised)")
        return prepared
    ensure_writable_dir(out_dir, "--data-dir")  # before tokenising, not after

    if from_hub:
        rows, add_eot = documents, True
    else:
        from datasets import Dataset

        rows, add_eot = Dataset.from_dict({"text": split_at_safe_points(text, CHUNK_CHARS)}), False
    print(f"[rosetrainer.data] tokenising {source} with {tokenizer_name} into {out_dir}")
    tokenized = rows.map(
        _tokenize_batch, batched=True, num_proc=_worker_count(len(rows), num_proc),
        remove_columns=rows.column_names, desc="tokenising",
        fn_kwargs={"tokenizer_name": tokenizer_name, "add_eot": add_eot},
    )  # fmt: skip
    meta = {
        "tokenizer_name": tokenizer_name,
        "source": source,
        "eot_id": tokenizer.eot_id,
        "vocab_size": tokenizer.n_vocab,
        "val_fraction": val_fraction,
        "dtype": TOKEN_DTYPE.name,
        "key": key,
        "text_sha256": _sha256(content),  # what a checkpoint remembers of its training data
    }
    return _write_splits(tokenized, out_dir, meta)


def _checked_settings(tokenizer_name: str, val_fraction: float, num_proc: int | None) -> Tokenizer:
    """The tokenizer, once the settings are known to be usable."""
    if not 0.0 < val_fraction < 1.0:
        raise RoseError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if num_proc is not None and num_proc < 1:
        raise RoseError(f"num_proc must be a positive integer, got {num_proc}")
    tokenizer = Tokenizer(tokenizer_name)
    if tokenizer.n_vocab > np.iinfo(TOKEN_DTYPE).max + 1:
        raise RoseError(
            f"tokenizer {tokenizer_name!r} has {tokenizer.n_vocab} ids; token files store "
            f"uint16, which holds 65,536 at most: choose a smaller vocabulary (e.g. gpt2)"
        )
    return tokenizer


def split_at_safe_points(text: str, chunk_chars: int) -> list[str]:
    """Cut `text` into pieces of about chunk_chars, only where SAFE_SPLIT allows."""
    chunks = []
    start = 0
    while len(text) - start > chunk_chars:
        cut = SAFE_SPLIT.search(text, start + chunk_chars)
        if cut is None:
            break
        chunks.append(text[start : cut.start()])
        start = cut.start()
    chunks.append(text[start:])
    return chunks


def _tokenize_batch(batch: dict[str, list[str]], tokenizer_name: str, add_eot: bool) -> dict:
    # Runs in datasets' worker processes too: it takes a name, not an encoding object,
    # and tiktoken keeps one encoding per process.
    encoding = get_encoding(tokenizer_name)
    eot = [encoding.eot_token] if add_eot else []
    ids = [
        np.array(encoding.encode_ordinary(text) + eot, dtype=TOKEN_DTYPE) for text in batch["text"]
    ]
    return {"ids": ids, "n_tokens": [len(row) for row in ids]}


def _worker_count(n_rows: int, num_proc: int | None) -> int | None:
    """datasets' num_proc: None (tokenise in this process) unless there is work to share."""
    if num_proc is None:
        num_proc = min(os.cpu_count() or 1, n_rows // ROWS_PER_PROCESS)
    num_proc = min(num_proc, n_rows)
    return num_proc if num_proc > 1 else None


def _write_splits(tokenized: Dataset, out_dir: Path, meta: dict[str, Any]) -> PreparedData:
    """Stream the token rows into train.bin then val.bin; meta.json last marks them complete.

    meta.json holds each file's sha256, so a token file damaged later is noticed."""
    n_tokens = int(sum(tokenized["n_tokens"]))
    n_train = int(n_tokens * (1.0 - meta["val_fraction"]))
    meta_path = out_dir / "meta.json"
    meta_path.unlink(missing_ok=True)  # without it, a prepare cut short is redone next time
    train_path, val_path = out_dir / "train.bin", out_dir / "val.bin"
    digests = {"train": hashlib.sha256(), "val": hashlib.sha256()}
    written = 0
    try:
        with open(train_path, "wb") as train_file, open(val_path, "wb") as val_file:
            for batch in tokenized.with_format("numpy").iter(batch_size=1024):
                ids = np.concatenate(batch["ids"]).astype(TOKEN_DTYPE)
                cut = min(max(n_train - written, 0), len(ids))
                for split, file, part in (
                    ("train", train_file, ids[:cut]),
                    ("val", val_file, ids[cut:]),
                ):
                    file.write(part.tobytes())
                    digests[split].update(part.tobytes())
                written += len(ids)
    except OSError as err:
        raise RoseError(os_error_line(err, out_dir, "write the token files to")) from None
    meta = {
        **meta,
        "n_train_tokens": n_train,
        "n_val_tokens": n_tokens - n_train,
        "train_sha256": digests["train"].hexdigest(),
        "val_sha256": digests["val"].hexdigest(),
    }
    write_bytes_atomically(meta_path, json.dumps(meta, indent=2).encode())
    return PreparedData(train_path, val_path, meta)


def _cached(out_dir: Path, key: str) -> PreparedData | None:
    """The finished result of an earlier prepare with the same key, if it is intact.

    A token file of the right size whose bytes changed (zeroed, overwritten) fails its
    sha256 and is tokenised again, with a note saying so."""
    train_path, val_path = out_dir / "train.bin", out_dir / "val.bin"
    try:
        meta = json.loads((out_dir / "meta.json").read_text(encoding="utf-8"))
        complete = (
            meta["key"] == key
            and train_path.stat().st_size == meta["n_train_tokens"] * TOKEN_DTYPE.itemsize
            and val_path.stat().st_size == meta["n_val_tokens"] * TOKEN_DTYPE.itemsize
        )
        if complete and not (
            _file_sha256(train_path) == meta["train_sha256"]
            and _file_sha256(val_path) == meta["val_sha256"]
        ):
            print(
                f"[rosetrainer.data] {out_dir}: token files fail their checksum; tokenising again"
            )
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return PreparedData(train_path, val_path, meta) if complete else None


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------
# Sources: a local file, TinyShakespeare, a Hugging Face dataset
# ---------------------------------------------------------------------------


def _read_text(path: Path) -> tuple[bytes, str]:
    """The file's exact bytes and their text: no newline translation, so CRLF stays CRLF."""
    why = not_a_file(path)
    if why is not None:
        raise RoseError(f"text file {path} {why}; pass --text-file with a UTF-8 text file")
    content = path.read_bytes()
    if not content:
        raise RoseError(f"text file {path} is empty; there is nothing to train on")
    try:
        return content, content.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RoseError(
            f"text file {path} is not UTF-8 (byte {err.start} is {content[err.start : err.start + 1]!r}); "
            f"convert it first, e.g. iconv -t UTF-8"
        ) from None


def download_tinyshakespeare(data_dir: Path) -> Path:
    """data_dir/tinyshakespeare.txt, downloaded unless a copy with the right sha256 is there."""
    path = data_dir / "tinyshakespeare.txt"
    if path.is_file() and _sha256(path.read_bytes()) == TINYSHAKESPEARE_SHA256:
        return path
    ensure_writable_dir(data_dir, "--data-dir")
    print(f"[rosetrainer.data] downloading {TINYSHAKESPEARE_URL}")
    try:
        with urllib.request.urlopen(TINYSHAKESPEARE_URL, timeout=60) as response:
            payload = response.read()
    except OSError as err:  # urllib's URLError and socket timeouts are both OSErrors
        found = " (the one there has the wrong sha256)" if path.exists() else ""
        raise RoseError(
            f"could not download TinyShakespeare ({err}); offline? pass --text-file PATH "
            f"(any UTF-8 text file) or put TinyShakespeare's input.txt at {path}{found}"
        ) from None
    digest = _sha256(payload)
    if digest != TINYSHAKESPEARE_SHA256:
        raise RoseError(
            f"the downloaded TinyShakespeare has sha256 {digest}, expected "
            f"{TINYSHAKESPEARE_SHA256}; it was not kept: try again, or pass --text-file PATH"
        )
    write_bytes_atomically(path, payload)
    return path


def _sha256(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def _load_hf_dataset(name: str) -> Dataset:
    from datasets import load_dataset

    try:
        documents = load_dataset(name, split="train")
    except Exception as err:  # no network, no such dataset, no "train" split: one message
        raise RoseError(
            f"could not load the Hugging Face dataset {name!r} ({one_line(err, False)}); offline? "
            f"pass --text-file PATH with a local UTF-8 text file instead"
        ) from None
    if "text" not in documents.column_names:
        raise RoseError(
            f"dataset {name!r} has no 'text' column (it has {', '.join(documents.column_names)})"
        )
    return documents.select_columns(["text"])


# ---------------------------------------------------------------------------
# Reading the token files back, and batches
# ---------------------------------------------------------------------------


def load_tokens(path: Path) -> np.memmap:
    """A read-only view of a token file: nothing is read until a batch touches it."""
    path = Path(path)
    if not path.is_file():
        raise RoseError(f"token file not found: {path}; prepare it with python -m rosetrainer.data")
    size = path.stat().st_size
    if size == 0 or size % TOKEN_DTYPE.itemsize:
        raise RoseError(f"{path} is not a token file ({size} bytes); prepare the data again")
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")


def get_batch(
    tokens: np.ndarray,
    batch_size: int,
    block_size: int,
    generator: torch.Generator,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """batch_size random windows: inputs x and targets y, the same tokens one step later."""
    n_starts = len(tokens) - block_size
    if n_starts < 1:
        raise RoseError(
            f"a split of {len(tokens)} tokens is too short for one window of block_size "
            f"{block_size} (it needs {block_size + 1}); use more text, a smaller block_size "
            f"or another val_fraction"
        )
    starts = torch.randint(n_starts, (batch_size,), generator=generator).tolist()
    x = torch.from_numpy(np.stack([tokens[s : s + block_size] for s in starts]).astype(np.int64))
    y = torch.from_numpy(
        np.stack([tokens[s + 1 : s + 1 + block_size] for s in starts]).astype(np.int64)
    )
    if torch.device(device).type == "cuda":
        # Page-locked memory lets the copy to the GPU run while the CPU goes on.
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(
            device, non_blocking=True
        )
    return x.to(device), y.to(device)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: _main(argv), "rosetrainer.data")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="rosetrainer.data",
        description="Tokenise text into train.bin / val.bin (uint16 token ids) for rosetrainer.train.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--text-file", help="a local UTF-8 text file (works offline)")
    source.add_argument(
        "--dataset",
        default="tinyshakespeare",
        help="tinyshakespeare (downloaded once) or a Hugging Face dataset name (needs the network)",
    )
    parser.add_argument("--data-dir", default="data", help="where the token files are cached")
    parser.add_argument("--tokenizer", default="gpt2", help="a tiktoken encoding name")
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument(
        "--num-proc", type=int, default=None, help="tokeniser processes (default: auto)"
    )
    return parser


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    prepared = prepare_data(
        text_file=args.text_file,
        dataset=args.dataset,
        data_dir=args.data_dir,
        tokenizer_name=args.tokenizer,
        val_fraction=args.val_fraction,
        num_proc=args.num_proc,
    )
    print(f"train: {prepared.train_path} ({prepared.meta['n_train_tokens']:,} tokens)")
    print(f"val:   {prepared.val_path} ({prepared.meta['n_val_tokens']:,} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
