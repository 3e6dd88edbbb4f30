"""What every command-line entry point of the project shares: one logging set-up, one-line argument errors.

Torch-free, so a bad flag fails before the seconds-long ``import torch``::

    from app.cli import OneLineParser, setup_logging
    setup_logging("rank 0")                     # 12:00:01 [rank 0] INFO ...; LOGLEVEL=DEBUG: everything
    parser = OneLineParser(prog="python -m app.x")   # a bad flag: one line on stderr, exit 2 (no usage block)
    first_line(error)                           # torch's many-line message, cut to its first line
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import typing
from collections.abc import Callable, Iterable

from app.exit_codes import BAD_CONFIG


def debug_requested(environ: typing.Mapping[str, str] = os.environ) -> bool:
    """``LOGLEVEL=DEBUG`` (the variable torchrun's own logging reads): every line, tracebacks included."""
    return environ.get("LOGLEVEL", "").upper() == "DEBUG"


def first_line(what: BaseException | str) -> str:
    """The first line of a message (torch's errors and reports run to many lines, a log line or a reason has one).

    An error that says nothing gives its type's name, so the line still names something; a blank text gives "".
    """
    text = str(what).strip()
    if text:
        return text.splitlines()[0]
    return type(what).__name__ if isinstance(what, BaseException) else ""


def setup_logging(
    tag: str,
    *,
    quiet: bool = False,
    line_filter: Callable[[logging.LogRecord], bool] | None = None,
    route: Iterable[str] = (),
) -> logging.Handler:
    """One format for every process: ``HH:MM:SS [tag] LEVEL message`` on stderr; returns the handler.

    Args:
        tag: who is speaking (``rank 1``, ``launch 3f2a...``, ``rendezvous_store``): several processes share a log.
        quiet: WARNING and above only (ranks other than 0: N copies of every INFO line help nobody).
        line_filter: applied unless LOGLEVEL=DEBUG (the launcher cuts torch's multi-line reports to one line).
        route: loggers that carry a handler of their own (torch's), sent through this one instead.
    """
    debug = debug_requested()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [{tag}] %(levelname)s %(message)s", "%H:%M:%S"))
    if line_filter is not None and not debug:
        handler.addFilter(line_filter)
    level = logging.DEBUG if debug else logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for name in route:
        routed = logging.getLogger(name)
        routed.handlers, routed.propagate = [handler], False
    return handler


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (``prog: error: ...; run with --help``) and exit 2, not usage + line.

    ``raise_as``: raise that exception with the line instead of exiting, for callers that report errors themselves
    (``app.worker.config`` raises ``ConfigError``, which ``app.train`` prints as ``config error: ...``).
    """

    def __init__(self, *args, raise_as: type[Exception] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.raise_as = raise_as

    def error(self, message: str) -> typing.NoReturn:
        line = f"{message}; run with --help for the flags"
        if self.raise_as is not None:
            raise self.raise_as(line)
        self.exit(BAD_CONFIG, f"{self.prog}: error: {line}\n")
