"""The configuration table of docs/training.md, generated from ``TrainConfig``'s fields, and its writer.

    python -m tools.config_table            # rewrite the table between docs/training.md's config-table markers
    make docs-config                        # the same

``tests/unit/test_docs.py`` fails when the docs hold another table, so a field added to
``app/worker/config/schema.py`` cannot be missing from the docs.
"""

from __future__ import annotations

import sys
from dataclasses import MISSING, fields
from pathlib import Path

from app.worker.config import TrainConfig, env_name, flag_name

DOC = Path(__file__).resolve().parents[1] / "docs" / "training.md"
BEGIN, END = "<!-- config-table:begin -->", "<!-- config-table:end -->"


def config_table_markdown() -> str:
    """The configuration table of docs/training.md, one row per ``TrainConfig`` field, from the fields themselves.

    ``make docs-config`` writes it into the docs (``write_table``); the test of the docs compares it with theirs,
    so a field added to TrainConfig cannot be missing there.

    Example::

        >>> print(config_table_markdown().splitlines()[2])
        | `model` | `DDP_MODEL` | `--model` | `mini_mlp` | model to train: mini_mlp \\| tiny_transformer |
    """

    def cell(text: str) -> str:
        return text.replace("|", "\\|")  # a bare | would end the Markdown cell

    rows = ["| field | env | flag | default | meaning |", "|---|---|---|---|---|"]
    for f in fields(TrainConfig):
        value = f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default
        default = "unset" if value is None else f"`{value!r}`" if value == "" else f"`{value}`"
        rows.append(
            f"| `{f.name}` | `{env_name(f.name)}` | `{flag_name(f.name)}` | {default} | {cell(f.metadata['doc'])} |"
        )
    return "\n".join(rows) + "\n"


def write_table(doc: Path = DOC) -> None:
    """Replace what lies between the config-table markers of ``doc`` with the table."""
    text = doc.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    doc.write_text(text[:start] + "\n" + config_table_markdown() + text[end:])


if __name__ == "__main__":
    write_table(Path(sys.argv[1]) if len(sys.argv) > 1 else DOC)
