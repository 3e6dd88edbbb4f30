"""Model parallelism on one host: a model's layers split into stages, each stage on its own device.

When a model does not fit one device, place groups of consecutive layers on different devices; ``forward`` moves
the activations from one device to the next, the loss is computed where the output lands (the last device, so the
labels go there), and backward and the optimizer work unchanged: autograd follows the ``.to(device)`` copies back.

    from app.worker.models import DeepMLP
    mp = ModelParallel(DeepMLP(width=64, depth=8), ["cuda:0", "cuda:1"])   # or ["cpu", "cpu"] anywhere
    loss = F.mse_loss(mp(x), y.to(mp.output_device))
    loss.backward(); optimizer.step()

Three questions decide how well it works:

- **How to split.** ``split_model`` cuts an ``nn.Sequential`` (the model itself or its ``.net``) into contiguous
  stages. A *layer* is a module with parameters plus the parameterless modules after it (``Linear`` + ``ReLU``).
  ``balance="params"`` minimises the largest stage's parameter count; ``balance="time"`` minimises the largest
  stage's measured forward+backward time on a sample input. The layer count need not divide evenly: 8 identical
  layers in 3 stages become 3+3+2 (earlier stages take the extra layer). More stages than layers is an error.
- **How to keep devices busy.** Here they are not: one micro-batch walks the devices one after the other, so
  with S devices each is idle (S−1)/S of the time. ``app.parallel.pipeline.stages`` fixes that with micro-batches.
- **How much crosses the wire.** ``ModelParallel.activation_bytes`` counts the activations moved at each stage
  boundary in the last forward (backward sends gradients of the same sizes the other way).

CPU stand-ins: ``devices=["cpu", "cpu"]`` runs the same code where no GPUs exist. Both "devices" are the same
device, so ``.to`` is a no-op and the result is bit-identical to the unsplit model: that proves the *mechanics*
(splitting, ordering, the labels' device, state-dict round trip), not any speed-up or memory saving.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

BALANCES = ("params", "time")


def sequential_of(model: nn.Module) -> tuple[nn.Sequential, str]:
    """The ``nn.Sequential`` to split and the prefix of its keys in ``model.state_dict()``.

    Args:
        model: an ``nn.Sequential``, or a module whose ``.net`` is one (``MiniMLP``, ``DeepMLP``).

    Example::

        seq, prefix = sequential_of(DeepMLP())  # (model.net, "net.")
    """
    if isinstance(model, nn.Sequential):
        return model, ""
    net = getattr(model, "net", None)
    if isinstance(net, nn.Sequential):
        return net, "net."
    raise ValueError(
        f"cannot split {type(model).__name__}: model and pipeline parallelism here split an nn.Sequential (the "
        f"model, or its .net attribute); express the model as one"
    )


def group_layers(seq: nn.Sequential) -> list[list[int]]:
    """Module indices of ``seq`` grouped into layers: each module with parameters starts a new layer, and the
    parameterless ones (activations, dropout) stay with the layer before them, so no stage starts with a ReLU."""
    layers: list[list[int]] = []
    for i, module in enumerate(seq):
        has_params = any(True for _ in module.parameters())
        if has_params or not layers:
            layers.append([i])
        else:
            layers[-1].append(i)
    return layers


def layer_costs(
    seq: nn.Sequential, layers: list[list[int]], balance: str, sample: torch.Tensor | None = None
) -> list[float]:
    """The cost of each layer: its parameter count, or its forward+backward seconds on ``sample`` (median of 3)."""
    if balance == "params":
        return [float(sum(p.numel() for i in layer for p in seq[i].parameters())) for layer in layers]
    if balance != "time":
        raise ValueError(f"balance={balance!r}: choose one of {', '.join(BALANCES)}")
    if sample is None:
        raise ValueError("balance='time' needs a sample input to time the layers on: pass sample=<one batch>")
    costs, x = [], sample
    for layer in layers:
        block = nn.Sequential(*(seq[i] for i in layer))
        times = []
        for _ in range(3):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = block(inp)
            out.sum().backward()
            times.append(time.perf_counter() - start)
        block.zero_grad(set_to_none=True)
        costs.append(statistics.median(times))
        x = out.detach()
    return costs


def balance_partition(costs: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """Split ``costs`` into ``num_stages`` contiguous, non-empty runs minimising the largest run's sum.

    Returns ``[(first, end), ...]`` layer ranges. Among the optimal splits, earlier stages take as many layers as
    the optimum allows, so identical layers split as evenly as possible with the remainder at the front.

    Example::

        balance_partition([1.0] * 8, 3)  # [(0, 3), (3, 6), (6, 8)]
    """
    n = len(costs)
    if num_stages < 1:
        raise ValueError(f"stages must be >= 1, got {num_stages}")
    if num_stages > n:
        raise ValueError(f"{num_stages} stages but the model has only {n} layers: use at most {n} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[s][i]: the smallest possible largest-stage cost when the first i layers form s stages.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            best[s][i] = min(max(best[s - 1][j], prefix[i] - prefix[j]) for j in range(s - 1, i))
    limit = best[num_stages][n] * (1 + 1e-9)
    ranges, first = [], 0
    for s in range(num_stages):
        stages_after = num_stages - s - 1
        end = first + 1 if stages_after else n
        while end < n - stages_after and prefix[end + 1] - prefix[first] <= limit:
            end += 1
        ranges.append((first, end))
        first = end
    return ranges


def split_model(
    model: nn.Module, num_stages: int, balance: str = "params", sample: torch.Tensor | None = None
) -> list[nn.Sequential]:
    """Cut ``model`` into ``num_stages`` consecutive ``nn.Sequential`` stages, balanced by ``balance``.

    The stages hold the model's own modules (no copy) under their original indices, so a stage's
    ``state_dict()`` keys are the model's keys minus the prefix (``"3.weight"`` for ``"net.3.weight"``), and
    ``merge_stage_state_dicts`` puts them back together.

    Args:
        model: an ``nn.Sequential`` or a module with one as ``.net``.
        num_stages: how many stages; at most the number of layers.
        balance: ``"params"`` (parameter count) or ``"time"`` (measured on ``sample``).
        sample: one input batch, needed for ``balance="time"``.

    Example::

        stages = split_model(DeepMLP(width=64, depth=8), 3)  # 3 + 3 + 2 Linear layers
    """
    seq, _ = sequential_of(model)
    layers = group_layers(seq)
    if num_stages > len(layers):
        raise ValueError(
            f"{num_stages} stages but {type(model).__name__} has only {len(layers)} layers (modules with "
            f"parameters): use at most {len(layers)} stages"
        )
    ranges = balance_partition(layer_costs(seq, layers, balance, sample), num_stages)
    stages = []
    for first, end in ranges:
        indices = [i for layer in layers[first:end] for i in layer]
        stages.append(nn.Sequential(OrderedDict((str(i), seq[i]) for i in indices)))
    return stages


def merge_stage_state_dicts(stage_state_dicts: Sequence[dict], prefix: str = "net.") -> dict:
    """One ``state_dict`` of the whole model from its stages' state dicts (in any order).

    Args:
        stage_state_dicts: each stage's ``state_dict()`` (keys as ``split_model`` names them; a ``module.`` prefix
            left by a DDP wrapper is removed).
        prefix: the model's key prefix for its ``nn.Sequential`` (``sequential_of(model)[1]``).

    Example::

        model.load_state_dict(merge_stage_state_dicts([s.state_dict() for s in stages]))
    """
    merged: dict = {}
    for sd in stage_state_dicts:
        for key, value in sd.items():
            key = key.removeprefix("module.")
            full = prefix + key
            if full in merged:
                raise ValueError(f"{full!r} appears in two stages' state dicts: they come from different splits")
            merged[full] = value
    return merged


class ModelParallel(nn.Module):
    """``model`` split into stages placed on ``devices``, one stage per device, in order.

    Args:
        model: an ``nn.Sequential`` or a module with one as ``.net``. Its modules are moved, not copied.
        devices: one device per stage, e.g. ``["cuda:0", "cuda:1"]`` or ``["cpu", "cpu"]`` (stand-ins).
        balance: ``"params"`` or ``"time"`` (see ``split_model``).
        sample: one input batch, for ``balance="time"``.

    Example::

        mp = ModelParallel(DeepMLP(width=64, depth=8), ["cpu", "cpu", "cpu"])
        F.mse_loss(mp(x), y.to(mp.output_device)).backward()
    """

    def __init__(
        self,
        model: nn.Module,
        devices: Sequence[str | torch.device],
        balance: str = "params",
        sample: torch.Tensor | None = None,
    ):
        super().__init__()
        if not devices:
            raise ValueError("devices is empty: give one device per stage, e.g. ['cuda:0', 'cuda:1']")
        self.devices = [torch.device(d) for d in devices]
        _, self.prefix = sequential_of(model)
        stages = split_model(model, len(self.devices), balance, sample)
        self.stages = nn.ModuleList(stage.to(device) for stage, device in zip(stages, self.devices))
        self.activation_bytes = 0  # bytes moved across stage boundaries by the last forward

    @property
    def output_device(self) -> torch.device:
        """Where the output (and so the loss) lands: put the labels here."""
        return self.devices[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moved = 0
        for i, (stage, device) in enumerate(zip(self.stages, self.devices)):
            if i > 0:
                moved += x.nelement() * x.element_size()  # what crosses this boundary (free on CPU stand-ins)
            # non_blocking lets a GPU→GPU copy overlap; autograd records the copy and sends gradients back.
            x = stage(x.to(device, non_blocking=True))
        self.activation_bytes = moved
        return x

    def stage_sizes(self) -> list[int]:
        """Parameters per stage."""
        return [sum(p.numel() for p in stage.parameters()) for stage in self.stages]

    def full_state_dict(self) -> dict:
        """The ``state_dict`` of the unsplit model (loadable into it without this wrapper), on the CPU."""
        return {
            k: v.cpu() for k, v in merge_stage_state_dicts([s.state_dict() for s in self.stages], self.prefix).items()
        }
