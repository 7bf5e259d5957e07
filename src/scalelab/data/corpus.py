"""A text corpus for a language model (`--model` with an (N, T, V) output and `--data-dir`).

The folder's `.txt` files (UTF-8, sorted by name) and AG News CSVs (`.csv`, the text column:
title + " " + description, data/agnews.py) are the documents, in that order, joined by a
newline (bytes) or the tokenizer's end-of-text token. Tokens are the UTF-8 bytes (vocab 256,
no dependency), or a Hugging Face tokenizer's ids with `--tokenizer NAME_OR_PATH`, loaded
from local files only. The stream is cut into windows of T + 1 tokens (next_token.windows):
item i is x = tokens[iT : iT + T], y = tokens[iT + 1 : iT + T + 1].
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from scalelab.data.agnews import read_agnews
from scalelab.errors import UsageError

BYTES = 256  # the byte-level vocabulary


def documents(folder: str) -> list[str]:
    """The folder's texts: every .txt file, then every AG News .csv's rows, by file name."""
    root = Path(folder)
    if not root.is_dir():
        raise UsageError(f"--data-dir {folder}: no such folder")
    files = sorted(p for p in root.iterdir() if p.suffix in (".txt", ".csv") and p.is_file())
    if not files:
        raise UsageError(f"--data-dir {folder}: no .txt files or AG News .csv to read as text")
    docs: list[str] = []
    for path in files:
        if path.suffix == ".csv":
            docs += read_agnews(path)[0]
            continue
        try:
            docs.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise UsageError(f"{path}: not UTF-8 text") from None
    return docs


def load_tokenizer(name: str):
    """A Hugging Face tokenizer from local files only (a folder, or a name in the local cache)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UsageError(
            f'--tokenizer {name}: needs transformers: pip install "scalelab[hf]"'
        ) from None
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception as exc:  # OSError / ValueError: not found locally, or not a tokenizer
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"--tokenizer {name}: not found in local files ({line[:160]})") from None


def vocab_size(tokenizer: str | None) -> int:
    return BYTES if tokenizer is None else len(load_tokenizer(tokenizer))


@functools.lru_cache(maxsize=2)
def tokens(folder: str, tokenizer: str | None) -> torch.Tensor:
    """The corpus as one (L,) int64 token stream."""
    docs = documents(folder)
    if tokenizer is None:
        data = "\n".join(docs).encode("utf-8")
        return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64))
    tok = load_tokenizer(tokenizer)
    sep = [tok.eos_token_id] if tok.eos_token_id is not None else []
    ids: list[int] = []
    for row in tok(docs, add_special_tokens=False)["input_ids"]:
        ids += row + sep
    return torch.tensor(ids, dtype=torch.int64)


def check(folder: str, tokenizer: str | None, vocab: int | None) -> None:
    """Before any work: the corpus reads, and its ids fit in [0, --vocab)."""
    need = vocab_size(tokenizer)
    if vocab is not None and vocab < need:
        what = "bytes" if tokenizer is None else f"tokenizer {tokenizer}"
        raise UsageError(f"--data-dir text as {what} has ids up to {need - 1}; pass --vocab {need}")
    tokens(folder, tokenizer)


def windows(stream: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A token stream (L,) -> (x, y), each (N, seq): consecutive windows of seq + 1 tokens
    (stride seq, so every token is a target once), x the first seq, y the last seq."""
    n = (len(stream) - 1) // seq
    idx = torch.arange(n).unsqueeze(1) * seq + torch.arange(seq + 1)  # (N, seq + 1)
    chunks = stream[idx]
    return chunks[:, :-1].contiguous(), chunks[:, 1:].contiguous()


def sequences(
    folder: str, seq: int, n: int, vocab: int | None, tokenizer: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n items (x, y), each (n, seq) int64."""
    check(folder, tokenizer, vocab)
    x, y = windows(tokens(folder, tokenizer), seq)
    if n > len(x):
        raise UsageError(
            f"--data-dir {folder}: {len(x)} sequences of {seq} + 1 tokens, {n} asked for; "
            "lower --train-size/--heldout-size (or --batch)"
        )
    return x[:n], y[:n]
