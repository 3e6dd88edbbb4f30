"""Streaming (iterable) data: a stream of ``(input, target)`` pairs dealt out a global batch at a time, resumable.

A ``data`` spec may return an iterable instead of a map-style set: a ``torch.utils.data.IterableDataset`` or any
object whose ``iter()`` yields ``(input, target)`` tensor pairs, the same stream in the same order on every rank
(seeded, deterministic). ``StreamBatches`` deals it out as ``GlobalBatches`` deals a map-style set: step ``t``
takes the stream's next ``global_batch`` samples and each rank keeps its contiguous share, so step ``t``'s samples
are the same at every world size. Every rank reads the whole global batch (and drops the other shares): the price
of a position that is one number, the same on every rank. When a pass ends, the next starts (``epoch + 1``,
``iter()`` again); a tail shorter than one global batch is skipped, as ``drop_last=True`` would.

Resuming (the checkpoint's ``"data"``: ``epoch``, ``consumed`` samples of this pass over all ranks, and ``stream``):

- a stream with ``state_dict()`` / ``load_state_dict()`` (the torchdata ``StatefulDataLoader`` convention) is
  asked for its state at each save and handed it back on resume, before its next ``iter()``, which continues from
  there: constant cost (``TokenStream`` below seeks to its byte offset);
- a stream without them must be re-iterable (``iter()`` starts it over, as a class with ``__iter__`` does): the
  resume reads and drops the ``consumed`` samples of this pass first, a cost that grows with the position;
- a one-shot iterator (a generator object) has neither: refused before training (``resumable``), exit 2.

``TokenStream`` is the built-in, the example to copy: text files read as bytes (one byte = one token, vocab 256) in
chunks, never whole, cut into the same next-token windows as app.worker.data_files' ``TokenWindows``::

    data: token_stream
    data_kwargs: {paths: ["corpus/*.txt"], seq_len: 128}
"""

from __future__ import annotations

import glob
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset

from app.worker.data import BatchShare, GlobalBatches, stack_samples


def is_stream(data: Any) -> bool:
    """An iterable data set rather than a map-style one (an ``IterableDataset`` even when it has ``__len__``)."""
    if isinstance(data, IterableDataset):
        return True
    return hasattr(data, "__iter__") and not (hasattr(data, "__getitem__") and hasattr(data, "__len__"))


def has_state(data: Any) -> bool:
    return callable(getattr(data, "state_dict", None)) and callable(getattr(data, "load_state_dict", None))


def resumable(data: Any) -> str | None:
    """Why ``data`` (a stream) cannot be resumed, or None when it can: stateful, or re-iterable from its start."""
    if has_state(data) or iter(data) is not data:
        return None
    return (
        f"a {type(data).__name__} is a one-shot iterator with no state_dict()/load_state_dict(), so a resume "
        f"could not find its place"
    )


def build_batches(dataset: Any, seed: int, share: BatchShare) -> GlobalBatches | StreamBatches:
    """The dealer of ``share`` for ``dataset``: ``StreamBatches`` for a stream (``seed`` unused: its order is its
    own), else ``GlobalBatches``."""
    place = (share.global_batch, share.micro_batch, share.rank, share.world_size)
    if is_stream(dataset):
        return StreamBatches(dataset, *place, share.device, share.dtype, share.equal_counts)
    return GlobalBatches(dataset, *place, seed, share.device, share.dtype, share.equal_counts)


class StreamBatches(BatchShare):
    """This rank's share of each step's global batch, taken from a stream (the members ``GlobalBatches`` has).

    Example::

        batches = StreamBatches(token_stream("corpus/*.txt", 64), 48, 8, rank=1, world_size=3,
                                device=torch.device("cpu"))
        micro_batches = batches.next_micro_batches()   # windows 16..31 of the stream, as 2 micro-batches of 8
    """

    def __init__(
        self,
        stream: Any,
        global_batch: int,
        micro_batch: int,
        rank: int,
        world_size: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        equal_counts: bool = False,
    ):
        if not world_size <= global_batch:
            raise ValueError(f"global batch {global_batch} must be at least world_size={world_size}")
        super().__init__(global_batch, micro_batch, rank, world_size, device, dtype, equal_counts)
        self.stream = stream
        self.stateful = has_state(stream)
        self.epoch = 0
        self.consumed = 0  # samples of this pass taken so far, by all ranks together
        self._iterator: Iterator | None = None  # opened at the first read: a resume's state arrives before it
        self._stream_state: dict | None = None

    def _open(self) -> Iterator:
        if self._stream_state is not None:  # resuming a stateful stream: its next iter() continues from there
            self.stream.load_state_dict(self._stream_state)
            self._stream_state = None
            return iter(self.stream)
        iterator = iter(self.stream)
        if self.consumed:  # re-iterable without a state: read and drop what this pass already used
            next(islice(iterator, self.consumed, self.consumed), None)
        return iterator

    def next_global_batch(self) -> list:
        """The stream's next ``global_batch`` samples (all ranks' shares); a new pass when this one runs short."""
        if self._iterator is None:
            self._iterator = self._open()
        batch = list(islice(self._iterator, self.global_batch))
        if len(batch) < self.global_batch:
            self.epoch, self.consumed = self.epoch + 1, 0
            self._iterator = iter(self.stream)
            batch = list(islice(self._iterator, self.global_batch))
            if len(batch) < self.global_batch:
                raise ValueError(
                    f"the data stream yields {len(batch)} samples in a pass, fewer than one global batch of "
                    f"{self.global_batch}; give it more samples, or lower micro_batch or effective_batch"
                )
        self.consumed += self.global_batch
        return batch

    def next_micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        share = self.next_global_batch()[self.start : self.start + self.local_samples]
        cuts = [sum(self.sizes[:i]) for i in range(len(self.sizes) + 1)]
        return [stack_samples(share[a:b], self.device, self.dtype) for a, b in zip(cuts, cuts[1:], strict=False)]

    def state_dict(self) -> dict[str, Any]:
        # Every rank has read the same samples, so every rank would save the same state, at any world size.
        stream = self._stream_state  # resumed and not read since: still the place it was given
        if self.stateful and self._iterator is not None:
            stream = self.stream.state_dict()
        return {"epoch": self.epoch, "consumed": self.consumed, "stream": stream}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self._stream_state = state.get("stream") if self.stateful else None
        self._iterator = None


class TokenStream(IterableDataset):
    """Next-token windows over files read as bytes, in chunks: files larger than memory stream through.

    Window ``i`` is bytes ``[i*L, i*L + L + 1)`` of the files concatenated in sorted path order (inputs and their
    next tokens, as ``TokenWindows``). Its state is the next window to yield; ``load_state_dict`` makes the next
    ``iter()`` seek straight there, and the one after that starts over.

    Args:
        paths: the files, in the order they are read.
        seq_len: tokens per input.
        chunk_bytes: bytes read at a time (what is held in memory, with one window).
    """

    def __init__(self, paths: list[Path], seq_len: int, chunk_bytes: int = 1 << 20):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len}: must be >= 1")
        self.paths, self.seq_len, self.chunk_bytes = paths, seq_len, max(chunk_bytes, seq_len + 1)
        self.sizes = [p.stat().st_size for p in paths]
        total = sum(self.sizes)
        if total < seq_len + 1:
            raise ValueError(f"{len(paths)} files hold {total} bytes, fewer than one window of seq_len + 1")
        self.windows = (total - 1) // seq_len
        self.position = 0  # the next window the current pass yields
        self._resume_at = 0

    def state_dict(self) -> dict[str, int]:
        return {"window": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume_at = int(state["window"])

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        first, self._resume_at = self._resume_at, 0
        self.position = first
        return self._windows(first)

    def _windows(self, first: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        size, buf, at = self.seq_len + 1, b"", 0
        for chunk in self._chunks(first * self.seq_len):
            buf, at = buf[at:] + chunk, 0  # the unread tail of the last chunk, then the new one
            while len(buf) - at >= size and self.position < self.windows:
                window = torch.frombuffer(bytearray(buf[at : at + size]), dtype=torch.uint8).long()
                at += self.seq_len  # windows overlap by one token: the last target is the next input
                self.position += 1  # before the yield: while the consumer holds it, state_dict() names the next
                yield window[:-1], window[1:]

    def _chunks(self, offset: int) -> Iterator[bytes]:
        for path, size in zip(self.paths, self.sizes, strict=True):
            if offset >= size:
                offset -= size
                continue
            with path.open("rb") as f:
                f.seek(offset)
                while chunk := f.read(self.chunk_bytes):
                    yield chunk
            offset = 0

    def describe(self) -> str:
        return f"{len(self.paths)} files, {sum(self.sizes)} bytes, {self.windows} windows of {self.seq_len} + 1"


def token_stream(paths: str | list[str], seq_len: int = 64, chunk_bytes: int = 1 << 20) -> TokenStream:
    """The files matching ``paths`` (glob patterns, ``**`` recursive), sorted, streamed as one byte sequence."""
    patterns = [paths] if isinstance(paths, str) else list(paths)
    found = sorted({Path(p) for pattern in patterns for p in glob.glob(pattern, recursive=True) if Path(p).is_file()})
    if not found:
        raise ValueError(f"paths={patterns}: no file matches; give existing files or glob patterns")
    return TokenStream(found, seq_len, chunk_bytes)
