"""Data sets read from files on disk: a stream of tokens cut into next-token windows, map-style for GlobalBatches.

    # YAML (configs/corpus.yaml): Python's own standard library as a byte-level corpus, on any machine, offline
    data: stdlib_corpus
    data_kwargs: {seq_len: 64, max_bytes: 1000000}
    # your text files (glob patterns, read in sorted order), one byte = one token (vocab 256)
    data: text_files
    data_kwargs: {paths: ["corpus/*.txt"], seq_len: 128}
    # a 1-D integer tensor of token ids saved with torch.save (your tokenizer's output)
    data: token_file
    data_kwargs: {path: tokens.pt, seq_len: 128}

``TokenWindows`` cuts the stream into windows of ``seq_len + 1`` tokens that overlap by one: sample ``i`` is
``(tokens[i*L : i*L + L], tokens[i*L + 1 : i*L + L + 1])``, the inputs and the next token at every position. So
each token but the first is a target exactly once per epoch, and GlobalBatches deals the windows out by index with
the same fixed-global-batch rule as the built-in sets. The tokens stay in one ``uint8`` (bytes) or ``int64``
tensor; a window is a view until it is stacked into a micro-batch.

Deterministic: files are read in sorted order of their paths and capped at ``max_bytes``, so every rank (and every
run on the same files) sees the same stream; ``describe`` names the files and the bytes' sha256 for provenance.
"""

from __future__ import annotations

import glob
import hashlib
import sysconfig
from pathlib import Path

import torch

# Parts of the stdlib tree that differ between installations (third-party packages) or are not plain library code.
STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test"}


class TokenWindows:
    """A map-style data set of next-token windows over a 1-D tensor of token ids.

    Args:
        tokens: 1-D integer tensor (``uint8`` for bytes, ``int64`` for a tokenizer's ids).
        seq_len: tokens per input; each sample holds ``seq_len`` inputs and their ``seq_len`` next tokens.
        source: what the tokens are (for ``describe``).
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, source: str = "tokens"):
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex():
            raise ValueError(f"{source}: tokens must be a 1-D integer tensor, got {tokens.dtype} {list(tokens.shape)}")
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len}: must be >= 1")
        if len(tokens) < seq_len + 1:
            raise ValueError(f"{source}: {len(tokens)} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}")
        self.tokens, self.seq_len, self.source = tokens, seq_len, source

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"window {i} of {len(self)}")
        start = (i % len(self)) * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].long()  # Embedding takes int64 ids
        return window[:-1], window[1:]

    def describe(self) -> str:
        return f"{self.source}: {len(self.tokens)} tokens, {len(self)} windows of {self.seq_len} + 1"


def read_files(paths: list[Path], max_bytes: int | None = None) -> tuple[bytes, list[Path]]:
    """The files' bytes concatenated in the given order, up to ``max_bytes``; and the files read (the last maybe
    in part)."""
    chunks, used, total = [], [], 0
    for path in paths:
        if max_bytes is not None and total >= max_bytes:
            break
        data = path.read_bytes()
        if max_bytes is not None:
            data = data[: max_bytes - total]
        chunks.append(data)
        used.append(path)
        total += len(data)
    return b"".join(chunks), used


def byte_windows(data: bytes, seq_len: int, source: str) -> TokenWindows:
    """Byte-level tokens (vocab 256): no tokenizer to download or to disagree between ranks."""
    digest = hashlib.sha256(data).hexdigest()[:12]
    return TokenWindows(torch.frombuffer(bytearray(data), dtype=torch.uint8), seq_len, f"{source}, sha256 {digest}")


def text_files(paths: str | list[str], seq_len: int = 64, max_bytes: int | None = None) -> TokenWindows:
    """The files matching ``paths`` (glob patterns, ``**`` recursive), sorted, as one byte stream."""
    patterns = [paths] if isinstance(paths, str) else list(paths)
    found = sorted({Path(p) for pattern in patterns for p in glob.glob(pattern, recursive=True) if Path(p).is_file()})
    if not found:
        raise ValueError(f"paths={patterns}: no file matches; give existing files or glob patterns")
    data, used = read_files(found, max_bytes)
    return byte_windows(data, seq_len, f"{len(used)} files matching {patterns}")


def token_file(path: str, seq_len: int = 64) -> TokenWindows:
    """A 1-D integer tensor saved with ``torch.save``, loaded with ``weights_only=True`` (no code runs on load)."""
    tokens = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(tokens, torch.Tensor):
        raise ValueError(f"path={path!r}: holds a {type(tokens).__name__}, not a tensor of token ids")
    return TokenWindows(tokens, seq_len, f"token file {path}")


def stdlib_files(root: str | None = None) -> list[Path]:
    """The ``.py`` files of Python's standard library, sorted by their path in it (a corpus every machine has)."""
    top = Path(root or sysconfig.get_paths()["stdlib"])
    found = [p for p in top.rglob("*.py") if not STDLIB_SKIP & set(p.relative_to(top).parts)]
    return sorted(found, key=lambda p: p.relative_to(top).as_posix())


def stdlib_corpus(
    seq_len: int = 64, max_bytes: int = 1_000_000, skip_bytes: int = 0, root: str | None = None
) -> TokenWindows:
    """Python's own standard library sources as bytes: ``max_bytes`` of them after the first ``skip_bytes``, in
    sorted file order (``skip_bytes``: a held-out set that follows the training bytes, as bench/corpus_curve.py's).

    The same on every machine with the same Python version (its stdlib ships with it); ``describe`` says which.
    """
    data, used = read_files(stdlib_files(root), skip_bytes + max_bytes)
    what = f"{len(used)} stdlib .py files of Python {sysconfig.get_python_version()}"
    return byte_windows(data[skip_bytes:], seq_len, what + (f" after byte {skip_bytes}" if skip_bytes else ""))
