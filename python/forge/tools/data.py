"""data.py — offline training text and batches for forge-train.

Nothing is downloaded. The built-in corpus is the Python standard library's own
sources (found through sysconfig: every machine that runs forge has them); where they
are missing (a stripped install), a generated corpus of simple English sentences
stands in. --data takes local text files or directories instead.

Tokenizers: bytes (vocabulary 256, the default), or a Hugging Face tokenizer when a
model directory ships one. Batches are a pure function of (seed, step): a resumed
run sees exactly the batches the uninterrupted run would have, with no sampler state
to save.
"""
from __future__ import annotations

import os
import random
import sysconfig
from typing import List, Optional, Sequence

import torch

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".c", ".h", ".cpp", ".json", ".html", ".tex",
                 ".csv", ".toml", ".cfg", ".ini", ".yaml", ".yml", ".sh", ".js")
# Cap on text read into memory; the built-in corpus uses a smaller one.
DEFAULT_MAX_BYTES = 256 << 20
BUILTIN_MAX_BYTES = 32 << 20
# Below this the built-in corpus falls back to generated text.
BUILTIN_MIN_BYTES = 1 << 20


class DataError(ValueError):
    """Bad --data input; the message is meant for the user."""


class ByteTokenizer:
    vocab_size = 256
    name = "bytes"

    def encode(self, text: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(text), dtype=torch.uint8)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer (from a model directory) behind the same interface."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.vocab_size = len(tokenizer)
        self.name = type(tokenizer).__name__

    def encode(self, text: bytes) -> torch.Tensor:
        ids = self.tok(text.decode("utf-8", errors="replace"), add_special_tokens=False,
                       return_attention_mask=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.int32)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))


def builtin_text_files() -> List[str]:
    """The standard library's .py files, sorted (test suites and site-packages left out)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "test",
                                                     "tests", "__pycache__", "idle_test"))
        files.extend(os.path.join(root, n) for n in sorted(names) if n.endswith(".py"))
    return files


def generated_text(n_bytes: int, seed: int = 0) -> bytes:
    """Deterministic simple English: enough structure for a loss curve to fall."""
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "my friend", "the teacher", "our team", "the old man",
                "a small bird", "the machine", "every student", "the river"]
    verbs = ["sees", "likes", "builds", "finds", "carries", "follows", "paints", "moves"]
    objects = ["the ball", "a red house", "two apples", "the long road", "a quiet song",
               "the blue sky", "three books", "an open door"]
    tails = ["today", "in the morning", "after the rain", "with great care", "again", "slowly"]
    out, size = [], 0
    while size < n_bytes:
        s = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(tails)}."
        s = s[0].upper() + s[1:] + ("\n" if rng.random() < 0.2 else " ")
        out.append(s)
        size += len(s)
    return "".join(out).encode()[:n_bytes]


def expand_paths(paths: Sequence[str]) -> List[str]:
    """Files named directly are taken as they are; directories give their text files."""
    files = []
    for path in paths:
        if not os.path.exists(path):
            raise DataError(f"data path does not exist: {path}")
        if os.path.isfile(path):
            files.append(path)
            continue
        found = []
        for root, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            found.extend(os.path.join(root, n) for n in sorted(names)
                         if n.lower().endswith(TEXT_SUFFIXES))
        if not found:
            raise DataError(f"no text files ({', '.join(TEXT_SUFFIXES)}) under {path}")
        files.extend(found)
    return files


def read_files(files: Sequence[str], max_bytes: int) -> bytes:
    chunks, total = [], 0
    for f in files:
        try:
            with open(f, "rb") as fh:
                data = fh.read(max_bytes - total)
        except OSError as e:
            raise DataError(f"cannot read {f}: {e.strerror}") from None
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"\n".join(chunks)


class TextData:
    """One token stream; batch(step) -> [batch_size, seq_len + 1] int64 tokens."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int,
                 description: str):
        if tokens.numel() < seq_len + 2:
            raise DataError(f"{description} has {tokens.numel()} tokens, fewer than one "
                            f"sequence of {seq_len + 1}")
        self.tokens = tokens
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.description = description
        self._offsets = torch.arange(seq_len + 1)

    def batch(self, step: int, device: Optional[torch.device] = None) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (self.batch_size,),
                               generator=g)
        rows = self.tokens[starts[:, None] + self._offsets].long()
        return rows if device is None else rows.to(device, non_blocking=True)


def text_size(n_bytes: int) -> str:
    """A size for the run's banner: bytes, KB below 1 MB, MB above (decimal units)."""
    if n_bytes < 1000:
        return f"{n_bytes} bytes"
    if n_bytes < 1000 ** 2:
        return f"{n_bytes / 1e3:.1f} KB"
    return f"{n_bytes / 1e6:.1f} MB"


def load_text(paths: Optional[Sequence[str]], max_bytes: int = DEFAULT_MAX_BYTES):
    """(text bytes, description) from --data paths, or the built-in corpus."""
    if paths:
        files = expand_paths(paths)
        text = read_files(files, max_bytes)
        if not text.strip():
            raise DataError(f"the data files hold no text: {', '.join(paths)}")
        return text, f"{len(files)} file(s), {text_size(len(text))}"
    files = builtin_text_files()
    text = read_files(files, min(max_bytes, BUILTIN_MAX_BYTES)) if files else b""
    if len(text) >= BUILTIN_MIN_BYTES:
        return text, (f"built-in: Python stdlib sources, {len(files)} files, "
                      f"{text_size(len(text))}")
    text = generated_text(4 << 20)
    return text, f"built-in: generated sentences, {text_size(len(text))}"


def make_data(paths, tokenizer, seq_len: int, batch_size: int, seed: int,
              max_bytes: int = DEFAULT_MAX_BYTES) -> TextData:
    text, description = load_text(paths, max_bytes)
    tokens = tokenizer.encode(text)
    return TextData(tokens, seq_len, batch_size, seed, description)
