"""Import specs: ``"package.module:callable"`` names a function or class to build something from, with keywords.

    >>> from app.specs import build, build_model
    >>> build_model("app.worker.models:MiniMLP", {"hidden": 32})   # a MiniMLP with hidden=32
    >>> build_model("mini_mlp")                                     # a built-in name: an alias of the spec above
    >>> build("tests.models_broken:dataset", {"size": 64})          # anything else: call it, keep what it returns

This is how a user's own model, data and loss reach the project's tools (``python -m app.check``, the worker's
``model``/``data``/``loss`` settings) without editing them: the module is imported, the attribute looked up, the
keywords checked against the callable's signature *before* calling it, and the result checked for the kind of object
asked for. Whatever is
wrong comes back as a ``SpecError`` (a ``ValueError``) whose one line names the spec and the cause, so a command
line tool can print it and exit with code 2 before any rank starts.

Torch-free at import: ``build_model`` imports torch only when called, so a tool can validate its other settings first.
"""

from __future__ import annotations

import importlib
import inspect
import traceback
from collections.abc import Callable, Mapping
from typing import Any

# The built-in models, as specs: `--model mini_mlp` and `--model app.worker.models:MiniMLP` are the same thing.
MODEL_SPECS = {
    "mini_mlp": "app.worker.models:MiniMLP",
    "deep_mlp": "app.worker.models:DeepMLP",
    "tiny_transformer": "app.worker.models:TinyTransformer",
}
# The built-in data sets and losses, the same way: the worker's `data: markov_sequences` is `app.worker.data:...`.
DATA_SPECS = {
    "teacher_classification": "app.worker.data:teacher_classification",
    "markov_sequences": "app.worker.data:markov_sequences",
    "text_files": "app.worker.data_files:text_files",
    "token_file": "app.worker.data_files:token_file",
    "stdlib_corpus": "app.worker.data_files:stdlib_corpus",
    "token_stream": "app.worker.data_stream:token_stream",
    "packed_files": "app.worker.data_pack:packed_files",
}
LOSS_SPECS = {
    "cross_entropy": "app.worker.data:cross_entropy",  # over the last dim: [B, C] and [B, T, C] outputs alike
    "mse": "torch.nn.functional:mse_loss",
}
# A built-in model's own data set and loss: what the worker trains when `data` / `loss` are unset.
MODEL_DATA = {"mini_mlp": "teacher_classification", "tiny_transformer": "markov_sequences"}
MODEL_LOSS = {"mini_mlp": "cross_entropy", "deep_mlp": "mse", "tiny_transformer": "cross_entropy"}


class SpecError(ValueError):
    """A spec that cannot be resolved, called or used; the message is one line naming the spec and the cause."""


def expand(spec: str, aliases: Mapping[str, str] | None = None) -> str:
    """The spec an alias stands for (``"mini_mlp"`` -> ``"app.worker.models:MiniMLP"``); a full spec unchanged."""
    if aliases and spec in aliases:
        return aliases[spec]
    if ":" not in spec:
        names = f", nor one of the names {', '.join(sorted(aliases))}" if aliases else ""
        raise SpecError(f"spec {spec!r}: expected 'package.module:callable' (no ':' in it){names}")
    return spec


def resolve(spec: str, aliases: Mapping[str, str] | None = None) -> Callable:
    """Import the module and return the attribute a spec names (dotted attributes work: ``mod:Class.create``)."""
    full = expand(spec, aliases)
    module_name, _, attr = full.partition(":")
    if not module_name or not attr:
        raise SpecError(f"spec {spec!r}: expected 'package.module:callable' (empty module or callable name)")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        # e.name is the module that failed, which may be one the spec's module imports, not the spec's module.
        failed = f"import of {e.name!r} failed" if e.name else "an import failed"
        raise SpecError(f"spec {spec!r}: module {module_name!r} does not import ({failed}: {e})") from None
    except Exception as e:  # the module's own code raised while importing: name where
        raise SpecError(f"spec {spec!r}: importing {module_name!r} raised {_one_line(e)}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SpecError(f"spec {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise SpecError(f"spec {spec!r}: {attr!r} is a {type(obj).__name__}, not a function or class")
    return obj


def check_kwargs(fn: Callable, kwargs: Mapping[str, Any], spec: str, *, partial: bool = False) -> None:
    """Raise ``SpecError`` unless ``fn(**kwargs)`` binds to ``fn``'s signature (checked without calling it);
    ``partial``: the keywords only, the call supplies the rest (a loss gets ``output, target``)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: the call itself will tell
    try:
        (signature.bind_partial if partial else signature.bind)(**kwargs)
    except TypeError as e:
        takes = [n for n, p in signature.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        raise SpecError(f"spec {spec!r}: {e} (it takes: {', '.join(takes) or 'no keywords'})") from None


def build(
    spec: str,
    kwargs: Mapping[str, Any] | None = None,
    *,
    returns: type | tuple[type, ...] | None = None,
    what: str | None = None,
    aliases: Mapping[str, str] | None = None,
) -> Any:
    """Resolve ``spec``, check and pass ``kwargs``, call it and check the result.

    Args:
        spec: ``"package.module:callable"``, or a key of ``aliases``.
        kwargs: keyword arguments for the callable (a dict, as read from YAML or JSON).
        returns: the type(s) the result must be an instance of; ``None`` accepts anything.
        what: how to name ``returns`` in the error (``"a torch.nn.Module"``).
        aliases: short names for specs, e.g. ``MODEL_SPECS``.
    """
    kwargs = dict(kwargs or {})
    fn = resolve(spec, aliases)
    check_kwargs(fn, kwargs, spec)
    try:
        result = fn(**kwargs)
    except Exception as e:
        raise SpecError(f"spec {spec!r}: calling it raised {_one_line(e)}") from None
    if returns is not None and not isinstance(result, returns):
        wanted = what or " or ".join(t.__name__ for t in (returns if isinstance(returns, tuple) else (returns,)))
        got = type(result).__name__
        raise SpecError(f"spec {spec!r}: returned {'an' if got[0] in 'aeiouAEIOU' else 'a'} {got}, not {wanted}")
    return result


def build_model(spec: str, kwargs: Mapping[str, Any] | None = None):
    """A ``torch.nn.Module`` from a spec or a built-in name (``MODEL_SPECS``)."""
    from torch import nn

    return build(spec, kwargs, returns=nn.Module, what="a torch.nn.Module", aliases=MODEL_SPECS)


def builtin_name(spec: str, aliases: Mapping[str, str]) -> str | None:
    """The alias ``spec`` is or stands for (``"app.worker.models:MiniMLP"`` -> ``"mini_mlp"``), else ``None``."""
    if spec in aliases:
        return spec
    return next((name for name, full in aliases.items() if full == spec), None)


def build_loss(spec: str, kwargs: Mapping[str, Any] | None = None, aliases: Mapping[str, str] | None = None):
    """The loss ``loss(output, target) -> scalar`` a spec names: a class is instantiated with the keywords
    (``torch.nn:CrossEntropyLoss``), a function used as it is with the keywords bound
    (``torch.nn.functional:smooth_l1_loss``)."""
    import functools

    fn = resolve(spec, aliases)
    if inspect.isclass(fn):
        return build(spec, kwargs, aliases=aliases)
    check_kwargs(fn, kwargs or {}, spec, partial=True)
    return functools.partial(fn, **kwargs) if kwargs else fn


def _one_line(e: BaseException) -> str:
    """``TypeError: message (file.py:12)``: the exception and the innermost frame it came from, on one line."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" ({frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno})" if frames else ""
    message = " ".join(str(e).split()) or "(no message)"
    return f"{type(e).__name__}: {message}{where}"
