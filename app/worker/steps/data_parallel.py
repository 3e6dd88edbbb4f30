"""``parallel=dp``: one process, ``nn.DataParallel`` over the visible GPUs, the ``parallel=ddp`` step otherwise."""

from __future__ import annotations

from torch import nn

from app.worker.steps.ddp import DDPStep


class DataParallelStep(DDPStep):
    """``parallel=dp``: one process, the model replicated on every visible GPU by ``nn.DataParallel`` each forward.

    ``DDPStep`` with the wrapper swapped (no DDP wrapper is built, so no gradient hooks are left on the
    parameters): the batch is scattered over the GPUs, the outputs gathered on ``cuda:0`` (which therefore holds
    more memory), the gradients summed back onto ``cuda:0``'s module. Checkpoints save the bare model, as for DDP.
    """

    def wrap(self, model: nn.Module) -> nn.Module:
        return nn.DataParallel(model)  # model (on cuda:0) stays the bare module; comm_probe finds nothing to time
