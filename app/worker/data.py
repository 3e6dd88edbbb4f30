"""Training data: generated deterministically from the seed (nothing downloaded), dealt out a global batch at a time.

Two built-in tasks, one per built-in model (``MODEL_DATA`` in app.specs; a user's own data set is a ``data`` spec,
app.worker.workload; files on disk: app.worker.data_files), each with structure the model can learn in well under
a minute on 2 CPU cores:

- ``mini_mlp``: teacher classification. A fixed random "teacher" network (seeded, never trained) labels Gaussian
  inputs with one of 8 classes; the student learns to imitate it. Loss starts near ln 8 = 2.08 and falls.
- ``tiny_transformer``: a Markov chain over 64 tokens in which each token has 4 possible successors with fixed
  probabilities (0.55 / 0.25 / 0.15 / 0.05). Next-token loss starts high (the head tied to N(0, 1) embeddings
  makes the first logits large: ~35 nats, not ln 64 = 4.16), is below 4 within ~40 steps and falls towards the
  chain's entropy, 1.11 nats: the floor no model can beat.

Every rank generates the same data set from ``seed``. ``GlobalBatches`` deals it out a global batch at a time: each
epoch is one permutation of the data set (seeded by ``seed + epoch``, as ``DistributedSampler`` shuffles), step
after step takes the next ``global_batch`` positions of it, and the ranks split that batch into contiguous shares.
A data set is either a ``Dataset`` (two tensors) or any map-style set (``__len__``, ``__getitem__(i) -> (input,
target)`` tensors), whose samples are stacked into micro-batches. So the samples of step ``t`` are the same at
every world size (only who processes which of them changes), and the position to resume from is one number,
samples consumed in the epoch, counted over all ranks. An epoch's tail shorter than one global batch is skipped, as
``drop_last=True`` would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from app.parallel.accum import micro_batch_sizes, split_global_batch

MLP_IN, MLP_CLASSES = 32, 8  # MiniMLP's default in/out features
VOCAB = 64  # TinyTransformer's default vocabulary
SUCCESSOR_PROBS = (0.55, 0.25, 0.15, 0.05)


@dataclass
class Dataset:
    """Inputs and targets as two tensors (the whole set fits in memory many times over)."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[i], self.targets[i]  # map-style too, so every data set reads the same way


def teacher_classification(size: int, seed: int) -> Dataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, MLP_IN, generator=gen)
    w1 = torch.randn(MLP_IN, 64, generator=gen) / MLP_IN**0.5
    w2 = torch.randn(64, MLP_CLASSES, generator=gen) / 8.0
    # Centre the teacher's logits per class so no class dominates: a balanced task starts at ln 8.
    logits = torch.tanh(x @ w1) @ w2
    logits = logits - logits.mean(dim=0)
    return Dataset(x, logits.argmax(dim=1))


def markov_sequences(size: int, seq_len: int, seed: int) -> Dataset:
    gen = torch.Generator().manual_seed(seed)
    successors = torch.stack([torch.randperm(VOCAB, generator=gen)[: len(SUCCESSOR_PROBS)] for _ in range(VOCAB)])
    probs = torch.tensor(SUCCESSOR_PROBS)
    tokens = torch.empty(size, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (size,), generator=gen)
    for t in range(seq_len):
        choice = torch.multinomial(probs, size, replacement=True, generator=gen)
        tokens[:, t + 1] = successors[tokens[:, t], choice]
    return Dataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def cross_entropy(output: torch.Tensor, target: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Cross-entropy over the last dim, a mean over every position: class logits ``[B, C]`` or next-token logits
    ``[B, T, C]`` alike (the built-in models' loss, ``loss: cross_entropy``); ``kwargs`` go to ``F.cross_entropy``."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1), **kwargs)


def stack_samples(pairs: list, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Collate ``(input, target)`` pairs by stacking (what ``default_collate`` does to tensors), onto the device,
    float inputs in the model's dtype (token ids stay integers)."""
    x, y = torch.stack([p[0] for p in pairs]).to(device), torch.stack([p[1] for p in pairs]).to(device)
    return (x.to(dtype) if x.is_floating_point() else x), y


def equal_micro_batch_count(global_batch: int, world_size: int, micro_batch: int) -> int:
    """Micro-batches of at most ``micro_batch`` that the largest share of ``global_batch`` over ``world_size``
    ranks takes: what every rank runs when their counts must be equal (``BatchShare(equal_counts=True)``)."""
    largest = -(-global_batch // world_size)
    return -(-largest // micro_batch)


class BatchShare:
    """Which samples of every global batch are this rank's, and how they are cut into micro-batches: what both
    dealers (``GlobalBatches`` and app.worker.data_stream's ``StreamBatches``) share.

    ``start`` and ``local_samples`` place this rank's contiguous share in the global batch (shares differ by at most
    one sample), ``sizes`` cuts it into micro-batches of at most ``micro_batch``, ``grad_scale`` weighs its gradient.
    ``equal_counts`` (or ``cut_equal_counts()``): every rank cuts its share into as many micro-batches as the
    largest share needs.
    """

    def __init__(
        self,
        global_batch: int,
        micro_batch: int,
        rank: int,
        world_size: int,
        device: torch.device,
        dtype: torch.dtype,
        equal_counts: bool = False,
    ):
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.device, self.dtype = device, dtype
        self.recut(rank, world_size, equal_counts)

    def recut(self, rank: int, world_size: int, equal_counts: bool | None = None) -> None:
        """Deal the same global batch over another world (a heal in place: app.worker.heal); a dealer's data set and
        position stay as they are. ``equal_counts`` None keeps this share's."""
        global_batch, micro_batch = self.global_batch, self.micro_batch
        self.rank, self.world_size = rank, world_size
        self.equal_counts = self.equal_counts if equal_counts is None else equal_counts
        self.start, self.local_samples = split_global_batch(global_batch, world_size, rank)
        self.sizes = micro_batch_sizes(self.local_samples, micro_batch)
        if self.equal_counts:
            self.cut_equal_counts()
        # The wrapper averages gradients over ranks; a share larger or smaller than 1/world_size must weigh more or
        # less, so the average is the full global batch's gradient.
        self.grad_scale = self.local_samples * world_size / global_batch

    def cut_equal_counts(self) -> None:
        """Cut this share into as many micro-batches as the largest share needs, for a kind whose every micro-batch
        runs a collective (a rank with one fewer would leave its peers waiting in it); a share smaller than that
        count is a ValueError."""
        count = equal_micro_batch_count(self.global_batch, self.world_size, self.micro_batch)
        if self.local_samples < count:
            raise ValueError(
                f"rank {self.rank}'s {self.local_samples} samples cannot fill the {count} micro-batches every rank runs"
            )
        base, extra = divmod(self.local_samples, count)  # as equal as possible, none above micro_batch
        self.sizes = [base + (1 if i < extra else 0) for i in range(count)]
        self.equal_counts = True


class GlobalBatches(BatchShare):
    """This rank's share of each step's global batch, as micro-batches of at most ``micro_batch`` samples.

    Args:
        dataset: the whole data set (every rank holds it all): a ``Dataset`` of two tensors, or a map-style set of
            ``(input, target)`` tensor pairs, read by index and stacked.
        global_batch: samples per optimizer step over all ranks.
        micro_batch: the most samples one forward/backward takes; a share is cut into as few micro-batches as that
            allows, as equal as possible.
        rank, world_size: this rank's place; shares differ by at most one sample.
        seed: the shuffle's seed (``seed + epoch`` per epoch, the same on every rank).
        device: where the batches are put.

    Example::

        batches = GlobalBatches(teacher_classification(2048, 0), 128, 32, rank=1, world_size=3, seed=0,
                                device=torch.device("cpu"))
        micro_batches = batches.next_micro_batches()   # rank 1's 43 samples of step 1, as 22 + 21
    """

    def __init__(
        self,
        dataset: Any,
        global_batch: int,
        micro_batch: int,
        rank: int,
        world_size: int,
        seed: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ):
        if not world_size <= global_batch <= len(dataset):
            raise ValueError(
                f"global batch {global_batch} must lie between world_size={world_size} and "
                f"dataset_size={len(dataset)}: raise dataset_size or change the batch"
            )
        super().__init__(global_batch, micro_batch, rank, world_size, device, dtype)
        self.size, self.seed = len(dataset), seed
        if isinstance(dataset, Dataset):
            # Token ids stay integers; float features take the model's precision (TrainConfig.dtype).
            floating = dataset.inputs.is_floating_point()
            self.inputs = dataset.inputs.to(device, dtype) if floating else dataset.inputs.to(device)
            self.targets = dataset.targets.to(device)
            self.samples = None
        else:  # map-style: read sample by sample when its micro-batch comes (a file-backed set need not fit twice)
            self.inputs = self.targets = None
            self.samples = dataset
        self.epoch = 0
        self.consumed = 0  # positions of this epoch's permutation used so far, by all ranks together
        self._order = self._permutation(self.epoch)

    def _permutation(self, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(self.size, generator=gen)
        return order if self.samples is not None else order.to(self.device)

    def next_indices(self) -> torch.Tensor:
        """This rank's share of the next step's global batch (indices into the data set)."""
        if self.consumed + self.global_batch > len(self._order):
            self.epoch += 1
            self.consumed = 0
            self._order = self._permutation(self.epoch)
        first = self.consumed + self.start
        self.consumed += self.global_batch
        return self._order[first : first + self.local_samples]

    def next_micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        idx = self.next_indices()
        if self.samples is None:
            return [(self.inputs[i], self.targets[i]) for i in torch.split(idx, self.sizes)]
        return [self._stack(i.tolist()) for i in torch.split(idx, self.sizes)]

    def _stack(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self.samples[i] for i in indices]
        return stack_samples(pairs, self.device, self.dtype)

    def state_dict(self) -> dict[str, int]:
        # Counted over all ranks: the same number at every world size, so a resume onto another world size
        # continues with the very next global batch.
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self._order = self._permutation(self.epoch)
        self.consumed = min(int(state["consumed"]), len(self._order))
