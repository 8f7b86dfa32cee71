"""The ``weightmap`` command line: a thin layer over the library.

Known errors become one line on stderr and an exit code (2 for usage and mapping errors, 1 for
data problems); ``--debug`` or ``WEIGHTMAP_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from weightmap._checkpoint import Checkpoint
from weightmap.errors import MappingError, MappingSyntaxError, WeightmapError

__all__ = ["main"]


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def _cmd_inspect(args: argparse.Namespace) -> int:
    with Checkpoint.open(args.checkpoint) as ckpt:
        rows = [
            (name, info.dtype, list(info.shape), info.nbytes, ckpt.file_of(name).name)
            for name, info in ckpt.tensors.items()
        ]
        total = sum(r[3] for r in rows)
        if args.json:
            doc = {
                "checkpoint": str(ckpt.root),
                "files": [p.name for p in ckpt.files],
                "tensors": [
                    {"name": n, "dtype": d, "shape": s, "bytes": b, "file": f}
                    for n, d, s, b, f in rows
                ],
                "total_tensors": len(rows),
                "total_bytes": total,
                "config": ckpt.config,
            }
            print(json.dumps(doc, indent=2))
            return 0
        rows.sort(key=lambda r: r[0])
        shapes = [str(r[2]) for r in rows]
        w_name = max([len(r[0]) for r in rows] + [4])
        w_shape = max([len(s) for s in shapes] + [5])
        print(f"{'name':<{w_name}}  {'dtype':<11}  {'shape':<{w_shape}}  {'bytes':>12}  file")
        for (name, dt, _, size, file), shape in zip(rows, shapes, strict=True):
            print(f"{name:<{w_name}}  {dt:<11}  {shape:<{w_shape}}  {size:>12,}  {file}")
        print(
            f"{len(rows)} tensors, {total:,} bytes ({_human(total)}) in {len(ckpt.files)} file(s)"
        )
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightmap", description="Remap tensor checkpoints between frameworks."
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error (or WEIGHTMAP_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    p = sub.add_parser("inspect", help="list a checkpoint's tensors")
    p.add_argument("checkpoint", help="a checkpoint folder or a .safetensors file")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("WEIGHTMAP_DEBUG", "") not in ("", "0")
    try:
        code: int = args.func(args)
        return code
    except (MappingSyntaxError, MappingError) as exc:
        if debug:
            raise
        print(f"weightmap: error: {exc}", file=sys.stderr)
        return 2
    except WeightmapError as exc:
        if debug:
            raise
        print(f"weightmap: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("weightmap: interrupted; nothing was committed", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `weightmap inspect ... | head` closes the pipe early; that is not an error.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
