"""Every place the project writes into torch's private internals: one small function per patch, and the check that
the installed torch is the one they were written for.

The *why* of each patch stays with its caller (``app.cluster.elastic``, ``app.cluster.forked_trainer``,
``app.worker.startup``); here is only the *how*: which private it touches and what it relies on. Each patch function
checks its privates, and torch's version, before it writes anything; the launchers call ``check_torch()`` among
their checks so that another torch ends the run in one line (exit 2) before any work::

    from app.torch_patches import TorchChanged, check_torch
    check_torch()  # else TorchChanged: "torch 2.14.0 is installed; these patches ... were written for torch 2.13.0 ..."

The version check is strict (the release, without a local suffix such as ``+cpu``, must equal ``TORCH_VERSION``),
and there is no switch to skip it. pyproject.toml pins torch exactly, so another version only comes with a deliberate
upgrade; and some of what the patches rely on cannot be seen by ``hasattr`` (what torch.optim calls of
``torch._dynamo``, that ``launch_agent`` looks its agent class up by name at each call). The privates that can be
looked up are checked first, so that a torch that moved one is named precisely. To move to a new torch: install it,
run ``tests/unit/test_torch_patches.py`` (a test per patch, on what torch does), port what fails, set
``TORCH_VERSION``. Torch-free at import: the launchers and the trainer's start-up clock import it before torch.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from collections.abc import Callable, Iterable

from app.exit_codes import BAD_CONFIG

TORCH_VERSION = "2.13.0"

RENDEZVOUS = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
AGENT = "torch.distributed.elastic.agent.server.local_elastic_agent"
# Each patch's privates, as "module:attribute.path", looked up before the patch writes anything.
PRIVATES: dict[str, tuple[str, ...]] = {
    "node identity": (f"{RENDEZVOUS}:DynamicRendezvousHandler._node_desc_generator._local_id",),
    "first world": (
        f"{RENDEZVOUS}:_DistributedRendezvousOpExecutor._add_to_participants",
        f"{RENDEZVOUS}:_DistributedRendezvousOpExecutor._mark_rendezvous_complete",
    ),
    "agent class": (
        "torch.distributed.launcher.api:LocalElasticAgent",
        *(f"{AGENT}:LocalElasticAgent.{step}" for step in ("_rendezvous", "_monitor_workers", "_restart_workers")),
        f"{AGENT}:LocalElasticAgent._shutdown",
    ),
    "forked trainer": ("torch.distributed.run:run_script_path", "torch.multiprocessing:_set_thread_name"),
    "deferred dynamo": ("torch:_disable_dynamo",),
}


class TorchChanged(RuntimeError):
    """The installed torch is not the one these patches were written for: ``str()`` is the one line to show,
    ``code`` the exit code (2: no retry installs another torch)."""

    code = BAD_CONFIG


def installed_version() -> str:
    import torch

    return torch.__version__


def _lookup(private: str) -> bool:
    module, _, path = private.partition(":")
    try:
        found = importlib.import_module(module)
    except ImportError:
        return False
    for name in path.split("."):
        if not hasattr(found, name):
            return False
        found = getattr(found, name)
    return True


def check_torch(patches: Iterable[str] = tuple(PRIVATES), version: str | None = None) -> None:
    """Raise ``TorchChanged`` (one line) unless every private of ``patches`` exists and ``version`` (default: the
    installed torch's) is ``TORCH_VERSION``, either with or without a local suffix (``2.13.0+cpu``)."""
    version = installed_version() if version is None else version
    advice = (
        f"these patches (app/torch_patches.py) were written for torch {TORCH_VERSION}: install torch=={TORCH_VERSION} "
        f"(pyproject.toml), or port them to {version} (tests/unit/test_torch_patches.py) and set TORCH_VERSION"
    )
    for patch in patches:
        for private in PRIVATES[patch]:
            if not _lookup(private):
                module, _, path = private.partition(":")
                raise TorchChanged(f"torch {version}: {path} is gone from {module} ({patch} patch); {advice}")
    if version.partition("+")[0] != TORCH_VERSION:
        raise TorchChanged(f"torch {version} is installed; {advice}")


def _checked(patch: str):
    """Decorate a patch function: check its privates and torch's version before it writes into torch."""

    def decorate(fn):
        @functools.wraps(fn)
        def patched(*args, **kwargs):
            check_torch((patch,))
            return fn(*args, **kwargs)

        return patched

    return decorate


@_checked("node identity")
def set_node_local_id(local_id: int) -> None:
    """Number the next rendezvous node of this process ``local_id``.

    torch names a rendezvous node (FQDN, pid, local id); the local id comes from one ``_NodeDescGenerator`` shared
    by every ``DynamicRendezvousHandler`` (the class attribute ``_node_desc_generator``), which counts from 0 in its
    private ``_local_id`` and adds 1 per node it names.
    """
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    DynamicRendezvousHandler._node_desc_generator._local_id = local_id


@_checked("first world")
def after_joining_participants(hook: Callable[[object, Callable[[], None]], None]) -> None:
    """Call ``hook(state, complete)`` each time this node adds itself to a round's participants.

    torch's c10d rendezvous does that in the private ``_DistributedRendezvousOpExecutor._add_to_participants``, on
    its own copy of the state (``self._state``, a ``_RendezvousState``) that it then writes to the store; the hook
    may change that state (``deadline``) or call ``complete()`` (the executor's ``_mark_rendezvous_complete``: the
    round is done, written with the same sync).
    """
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _DistributedRendezvousOpExecutor as Executor

    add = Executor._add_to_participants

    def add_then_hook(self) -> None:
        add(self)
        hook(self._state, self._mark_rendezvous_complete)

    Executor._add_to_participants = add_then_hook


@_checked("agent class")
def use_agent_class(agent_class: type) -> None:
    """Make ``elastic_launch`` (torchrun's ``run``) build ``agent_class``, a subclass of torch's LocalElasticAgent.

    ``torch.distributed.launcher.api.launch_agent`` looks ``LocalElasticAgent`` up among its module's names at each
    call. A subclass that overrides the agent's private steps (``_rendezvous``, ``_monitor_workers``,
    ``_restart_workers``, ``_shutdown``) runs them within torch's loop.
    """
    import torch.distributed.launcher.api as launcher_api

    launcher_api.LocalElasticAgent = agent_class


@_checked("forked trainer")
def set_run_script_path(entrypoint: Callable[..., None]) -> None:
    """Make torchrun's ``--run-path`` call ``entrypoint(training_script, *its arguments)`` in each worker process.

    ``torch.distributed.run.config_from_args`` reads the module's ``run_script_path`` at each call, as the
    entrypoint for ``--run-path``; torch's own runs the script with ``runpy`` in the process.
    """
    import torch.distributed.run as torchrun

    torchrun.run_script_path = entrypoint


@_checked("forked trainer")
def set_thread_name(name: str) -> None:
    """Name this process's thread (``ps``, ``top``, ``pgrep`` show it): torch.multiprocessing's private helper,
    with which torchrun names its agent ``pt_elastic``."""
    import torch.multiprocessing

    torch.multiprocessing._set_thread_name(name)


# -- torch._dynamo, deferred ----------------------------------------------------------------------------------------
class DeferredDynamo(types.ModuleType):
    """Stands in for ``torch._dynamo`` until something needs more of it than torch.optim does.

    torch.optim imports torch._dynamo (the compiler's front end) at its first optimizer and calls two things of it
    on every step: ``disable(fn)`` (keep the compiler out of fn; through ``torch._disable_dynamo``) and
    ``graph_break()`` (split a compiled graph here). Without torch.compile nothing is compiled, so ``disable`` has
    nothing to keep out and there is no graph to break: both are exactly no-ops then. Anything else (torch.compile, a
    submodule, any other name) imports the real torch._dynamo in this stand-in's place, and from then on everything
    is torch's own.
    """

    def disable(self, fn=None, recursive=True, **kwargs):
        return fn if fn is not None else (lambda f: f)

    def graph_break(self, msg=""):
        return None

    def __getattr__(self, name: str):
        if name.startswith("__") and name != "__path__":  # probes such as inspect's hasattr(m, "__file__")
            raise AttributeError(name)
        return getattr(_load_real_dynamo(), name)  # __path__ too: `import torch._dynamo.x` then finds the real one


def _load_real_dynamo():
    import torch

    if isinstance(sys.modules.get("torch._dynamo"), DeferredDynamo):
        del sys.modules["torch._dynamo"]
        vars(torch).pop("_dynamo", None)
    real = importlib.import_module("torch._dynamo")
    torch._dynamo = real
    return real


@_checked("deferred dynamo")
def defer_dynamo() -> None:
    """Put a ``DeferredDynamo`` where ``import torch._dynamo`` finds it (``sys.modules``) and where ``torch._dynamo``
    reads it (torch's module attribute), until something needs the real one."""
    import torch

    stand_in = DeferredDynamo("torch._dynamo")
    sys.modules["torch._dynamo"] = stand_in
    torch._dynamo = stand_in
