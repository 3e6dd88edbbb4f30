"""Take the trained model out: one consolidated ``state_dict`` from any kind's checkpoint, as .pt or .safetensors.

    python -m app.export runs/ckpt model.safetensors        # the newest checkpoint of any kind (ddp, zero1-3,
    python -m app.export runs/ckpt/step-00000200.pt model.pt  #   a plain step file, or a bare state_dict file)

The output loads into the bare model with no wrapper and no process group::

    model.load_state_dict(torch.load("model.pt", weights_only=True))
    model.load_state_dict(safetensors.torch.load_file("model.safetensors"))

A sharded checkpoint (ZeRO 1-3, any world size) is consolidated on this one process, one shard file at a time; the
output is written atomically (app.files), so a failed export leaves no half file. Bad input: one line, exit 2.
``.safetensors`` needs the ``safetensors`` package (``pip install 'ddp-cluster[export]'``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from app import exit_codes
from app.cli import OneLineParser
from app.files import write_atomically
from app.worker.checkpoint.weights import WeightsError, read_model_state

FORMATS = (".pt", ".safetensors")


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m app.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a checkpoint_dir, a step-*.pt checkpoint, or a state_dict .pt/.safetensors")
    parser.add_argument("output", help="where to write the model's state_dict: *.pt or *.safetensors")
    return parser


def export(source: str, output: str) -> int:
    """Write ``source``'s model state to ``output``; returns the number of tensors written."""
    out = Path(output)
    if out.suffix not in FORMATS:
        raise WeightsError(f"{output}: name it *.pt or *.safetensors (the format follows the extension)")
    if not out.parent.is_dir():
        raise WeightsError(f"{output}: its directory {out.parent} does not exist")
    state = read_model_state(source)
    # Each tensor its own compact copy: tied weights and views of a flat shard would otherwise be written with
    # their whole storage (torch.save) or refused as shared memory (safetensors).
    state = {name: t.detach().contiguous().clone() for name, t in state.items()}
    if out.suffix == ".safetensors":
        try:
            from safetensors.torch import save
        except ImportError:
            raise WeightsError(
                f"{output}: writing .safetensors needs the safetensors package: pip install safetensors"
            ) from None
        data = save(state)
        write_atomically(out, lambda f: f.write(data))
    else:
        write_atomically(out, lambda f: torch.save(state, f))
    return len(state)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        n = export(args.source, args.output)
    except (WeightsError, OSError) as e:
        print(f"python -m app.export: error: {e}", file=sys.stderr)
        return exit_codes.BAD_CONFIG
    print(f"exported {n} tensors from {args.source} to {args.output}")
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
