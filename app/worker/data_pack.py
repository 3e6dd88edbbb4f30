"""Sequence packing: documents of any length packed into fixed-length next-token windows, a resumable stream.

Each document (a list of token ids) is followed by the separator ``sep`` (your tokenizer's end-of-document id)
and the documents are laid end to end in their order; the packed tokens are cut into windows of ``seq_len + 1``
that overlap by one, as ``TokenStream`` cuts a file (inputs and the next token at each position). No padding: a
document longer than a window runs on into the next, a short one shares its window with the next documents, and
only the tail of a pass shorter than one window is left out. Attention crosses document boundaries within a
window: the model sees ``sep`` where one document ends and learns that what follows it does not depend on what came
before it (the common choice of GPT-style pre-training; no per-document mask or position reset).

Two sources of documents:

- files, one document per line (``packed_files``): ``*.jsonl`` lines are JSON lists of token ids (your
  tokenizer's output), any other file's lines are text whose UTF-8 bytes are the tokens (vocab 256); blank lines
  are no document. As a data spec::

      data: packed_files
      data_kwargs: {paths: ["docs/*.jsonl"], seq_len: 128, sep: 50256}

- any re-iterable of documents in Python (a list, or a class whose ``__iter__`` starts over)::

      def my_data():                                   # data: mypkg.data:my_data
          return packed_documents(MyDocuments(), seq_len=128, sep=2)

Resumable (app.worker.data_stream): the state names the next window's first token as the place of its document
and the tokens of that document already used. A file's place is its index and the line's byte offset, so a resume
seeks straight there (constant cost); an iterable's place is the document's index, so a resume reads and drops the
documents before it. Deterministic: files in sorted path order, every rank the same stream. Memory: one document
(one line) at a time, whole, and the unfinished window.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset

Place = Any  # where a document starts in its source (JSON-able: it is saved in the checkpoint)


class PackedTokens(IterableDataset):
    """Documents from ``source`` packed into next-token windows of ``seq_len`` (module docstring).

    Args:
        source: what yields the documents: ``documents(start)`` yields ``(place, tokens)`` from the document at
            ``start`` (None: the first) on; ``LineFiles`` or ``DocumentList``.
        seq_len: tokens per input.
        sep: the end-of-document token appended to every document.
    """

    def __init__(self, source: Any, seq_len: int, sep: int):
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r}: must be an integer >= 1")
        if not isinstance(sep, int) or sep < 0:
            raise ValueError(f"sep={sep!r}: must be a token id, an integer >= 0 (your end-of-document token)")
        self.source, self.seq_len, self.sep = source, seq_len, sep
        self.position = 0  # windows of this pass yielded so far
        self.next_start: dict[str, Any] = {"place": None, "skip": 0}  # where the next window's first token is
        self._resume: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.position, **self.next_start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = {"window": int(state["window"]), "place": state["place"], "skip": int(state["skip"])}

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        start, self._resume = self._resume or {"window": 0, "place": None, "skip": 0}, None
        self.position, self.next_start = start["window"], {"place": start["place"], "skip": start["skip"]}
        return self._windows(start["place"], start["skip"])

    def _windows(self, place: Place, skip: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        size = self.seq_len + 1
        buf: list[int] = []
        starts: list[tuple[int, Place, int]] = []  # (index in buf, document place, its tokens before that index)
        for doc_place, tokens in self.source.documents(place):
            tokens = [*tokens, self.sep][skip:]
            starts.append((len(buf), doc_place, skip))
            buf.extend(tokens)
            skip = 0  # only the first document of a resume starts part-way
            at = 0
            while len(buf) - at >= size:
                window = torch.tensor(buf[at : at + size], dtype=torch.long)
                at += self.seq_len  # windows overlap by one token: the last target is the next input
                self.position += 1  # before the yield: while the consumer holds it, state_dict() names the next
                self.next_start = _place_of(starts, at)
                yield window[:-1], window[1:]
            buf, starts = buf[at:], _shifted(starts, at)

    def describe(self) -> str:
        return f"{self.source.describe()}, packed with sep={self.sep} into windows of {self.seq_len} + 1"


def _place_of(starts: list[tuple[int, Place, int]], index: int) -> dict[str, Any]:
    """The place of token ``index`` of the buffer: its document's place and the tokens of it before."""
    begin, place, before = next(s for s in reversed(starts) if s[0] <= index)
    return {"place": place, "skip": before + index - begin}


def _shifted(starts: list[tuple[int, Place, int]], cut: int) -> list[tuple[int, Place, int]]:
    """``starts`` once the buffer's first ``cut`` tokens are dropped: the document holding the new first token
    starts at 0, part-way through it."""
    kept = [s for s in starts if s[0] > cut]
    first = _place_of(starts, cut)
    return [(0, first["place"], first["skip"])] + [(i - cut, p, b) for i, p, b in kept]


class LineFiles:
    """Documents as the lines of files read in order; a place is ``[file index, byte offset of the line]``.

    ``*.jsonl``: each line a JSON list of token ids; otherwise a line's UTF-8 bytes (without its line break) are
    its tokens. Blank lines are skipped.
    """

    def __init__(self, paths: list[Path]):
        self.paths = paths

    def documents(self, start: Place = None) -> Iterator[tuple[Place, list[int]]]:
        first, offset = start if start is not None else (0, 0)
        for index in range(first, len(self.paths)):
            path = self.paths[index]
            with path.open("rb") as f:
                f.seek(offset if index == first else 0)
                at = f.tell()
                for line in f:
                    tokens = self._tokens(path, line, at)
                    if tokens:
                        yield [index, at], tokens
                    at += len(line)

    @staticmethod
    def _tokens(path: Path, line: bytes, at: int) -> list[int]:
        text = line.rstrip(b"\r\n")
        if path.suffix != ".jsonl":
            return list(text)
        if not text.strip():
            return []
        try:
            tokens = json.loads(text)
        except ValueError:
            tokens = None
        # (named by byte offset, not line number: a resume seeks into the file and never counts the lines before)
        if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
            raise ValueError(
                f"{path}: the line at byte {at} is not a JSON list of token ids (integers >= 0); write one "
                f"document per line as [id, id, ...]"
            )
        return tokens

    def describe(self) -> str:
        return f"{len(self.paths)} files of one document per line, {sum(p.stat().st_size for p in self.paths)} bytes"


class DocumentList:
    """Documents from a re-iterable of token-id sequences; a place is the document's index (a resume reads and
    drops the documents before it)."""

    def __init__(self, documents: Iterable[Iterable[int]]):
        if iter(documents) is documents:
            raise ValueError(
                f"documents: a {type(documents).__name__} is a one-shot iterator, so a resume could not find its "
                f"place; pass a list or a class whose __iter__ starts the documents over"
            )
        self.items = documents

    def documents(self, start: Place = None) -> Iterator[tuple[Place, list[int]]]:
        first = start or 0
        for index, doc in enumerate(self.items):
            if index >= first:
                yield index, [int(t) for t in doc]

    def describe(self) -> str:
        return f"the documents of a {type(self.items).__name__}"


def packed_documents(documents: Iterable[Iterable[int]], seq_len: int, sep: int) -> PackedTokens:
    """A re-iterable of documents (lists of token ids) packed into windows of ``seq_len`` with ``sep`` after each."""
    return PackedTokens(DocumentList(documents), seq_len, sep)


def packed_files(paths: str | list[str], seq_len: int, sep: int) -> PackedTokens:
    """The files matching ``paths`` (glob patterns, ``**`` recursive), sorted, one document per line, packed."""
    patterns = [paths] if isinstance(paths, str) else list(paths)
    found = sorted({Path(p) for pattern in patterns for p in glob.glob(pattern, recursive=True) if Path(p).is_file()})
    if not found:
        raise ValueError(f"paths={patterns}: no file matches; give existing files or glob patterns")
    return PackedTokens(LineFiles(found), seq_len, sep)
