"""The write path at 4 GB: a cast and a transpose of every tensor, against the physical limits.

    python bench/bench_write.py [--repeat 3] [--gb 4] [--baseline SRC] [--workdir DIR]
                                [--no-write]
    python bench/bench_write.py --in-a-row [--repeat 4] [--gb 2] [--baseline SRC]

A checkpoint of bf16 [4096, 14336] tensors (4.1 GB by default; every byte written, from a
repeated random block) is converted two ways: every tensor cast to f32 (twice the bytes
written) and every tensor transposed. Each weightmap run is set beside the two limits no
conversion can beat: writing the output's bytes with O_DIRECT from two threads (fsynced), and
torch's own operation on the tensors already in memory (``.to(torch.float32)``,
``.T.contiguous()``; loaded before the clock). The conversion's target is 1.3x the larger of
the two. Also measured: weightmap with its computed chunks written past the page cache
(``WEIGHTMAP_DIRECT_IO=1``), and ``--baseline SRC``, a ``src/`` tree of another commit (e.g.
unpacked with ``git archive``), as **before**.

On the virtual disk this was written on, the first few GB written through the page cache
after a run that wrote with O_DIRECT (and deleted its output) took several times as long as
usual, whatever the pause between them; the runs are interleaved, so after every job that
writes with O_DIRECT an untimed 4 GB write through the page cache (fsynced, then deleted)
takes that cost, and the next job starts as it would after any other.

Each run is a fresh process (``bench/_job.py``), interleaved, warm page cache for the input,
output deleted and synced between runs; medians, with peak RSS (``ru_maxrss``). The outputs
of every weightmap variant are compared bit for bit with the first. Writes the section "The
write path" of docs/benchmarks.md (``--no-write``: print it only).

``--in-a-row`` measures the cast alone, each weightmap variant's runs one after the other (after
one untimed run of it) instead of interleaved, with no settling write: the steady state of each
way of writing, and what the first run through the page cache after direct ones costs. Writes
the section "Direct writes".
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from checkpoints import warm
from common import command_line, scratch
from jobs import SOURCES, Launcher, Runner, Samples
from sections import write_section

SECTION = "## The write path"
SHAPE = (4096, 14336)
OPS = {
    "cast bf16 -> f32": ("to-f32", 'weightmap 1\ncast "{x*}" to f32 where dtype == bf16\n'),
    "transpose": ("transpose", 'weightmap 1\ntranspose "{x*}"\n'),
}


def write_checkpoint(folder: Path, gb: float) -> int:
    """bf16 tensors of ``SHAPE`` adding up to about ``gb`` GB; returns the file's bytes."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    count = max(1, round(gb * 1e9 / (SHAPE[0] * SHAPE[1] * 2)))
    block = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3)).bfloat16()
    n = SHAPE[0] * SHAPE[1]
    tensors = {
        f"layers.{i}.weight": block.roll(i * 7919).repeat(-(-n // block.numel()))[:n]
        .reshape(SHAPE).clone()
        for i in range(count)
    }  # fmt: skip
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return (folder / "model.safetensors").stat().st_size


def _digest(out: Path) -> str:
    """One hash of every file of the output (an 8 GB output is two shards and an index)."""
    h = hashlib.sha256()
    for path in sorted(out.iterdir()):
        h.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


class _Settling(Runner):
    """A runner that writes 4 GB through the page cache (untimed), once the output is gone,
    after each job that wrote with O_DIRECT (see the module's docstring)."""

    direct = False

    def job(self, args: Sequence[str], **kw: Any) -> dict[str, Any]:
        self.direct = "--direct" in args or args[0] == "direct-write"
        return super().job(args, **kw)

    def clean(self) -> None:
        super().clean()
        if self.direct:
            self.direct = False
            settle = self.workdir / "settle.bin"
            block = os.urandom(2**20) * 16
            with settle.open("wb") as f:
                for _ in range(256):
                    f.write(block)
                f.flush()
                os.fsync(f.fileno())
            settle.unlink()
            os.sync()


def _row(name: str, s: Samples, limit: float) -> str:
    if s.failures:
        return f"| {name} | failed: {s.failures[0]} | | |"
    wall = s.median("seconds")
    ratio = f"{wall / limit:.2f}x" if limit == limit else ""
    return f"| {name} | {wall:.2f} s | {ratio} | {s.median('rss_peak'):,.0f} MiB |"


@contextmanager
def _setup(args: argparse.Namespace) -> Iterator[tuple[Launcher, Path, Path, int]]:
    """The launcher, a scratch folder and the checkpoint in it (``args.gb``), with its bytes;
    the baseline tree registered as **before**. Everything is removed afterwards."""
    launcher = Launcher()  # (started before anything heavy: see bench/jobs.py)
    workdir = scratch("weightmap-write-", args.workdir)
    try:
        if args.baseline is not None:
            SOURCES["before"] = args.baseline.resolve()
        src = workdir / "bf16"
        yield launcher, workdir, src, write_checkpoint(src, args.gb)
    finally:
        launcher.close()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--gb", type=float, default=4.0, help="the checkpoint's size")
    p.add_argument("--baseline", type=Path, help="a src/ tree to run as the before column")
    p.add_argument("--workdir", type=Path, help="scratch folder (default: a temporary one)")
    p.add_argument("--no-write", action="store_true", help="print the section only")
    p.add_argument("--in-a-row", action="store_true", help="runs of one kind in a row")
    args = p.parse_args()
    args.said = command_line("bench_write.py", p, args)  # (how the report says it was run)
    if args.in_a_row:
        in_a_row(args)
        return
    tables: list[str] = []
    with _setup(args) as (launcher, workdir, src, nbytes):
        runner = _Settling(workdir, launcher)
        out = str(runner.out)
        for title, (op, mapping_text) in OPS.items():
            mapping = workdir / f"{op}.wm"
            mapping.write_text(mapping_text)
            written = nbytes * 2 if op == "to-f32" else nbytes
            wm = ["weightmap", str(src), out, "--mapping", str(mapping), "--torch"]
            tools = {
                "weightmap": wm,
                "weightmap, WEIGHTMAP_DIRECT_IO=1": [*wm, "--direct"],
            }
            if args.baseline is not None:
                tools["before"] = wm
            tools["O_DIRECT write of the output's bytes"] = ["direct-write", out, str(written)]
            tools["torch, in memory"] = ["in-memory", str(src), op]
            digests: dict[str, str] = {}

            def check(name: str, folder: Path, digests: dict[str, str] = digests) -> None:
                if not name.startswith(("weightmap", "before")):
                    return
                digests[name] = _digest(folder)
                if len(set(digests.values())) > 1:
                    raise ValueError(f"{name}'s output differs from {next(iter(digests))}'s")

            samples = runner.compare(
                {name: (lambda a=a: a) for name, a in tools.items()}, [src], args.repeat,
                check=check,
            )  # fmt: skip
            direct = samples["O_DIRECT write of the output's bytes"].median("seconds")
            memory = samples["torch, in memory"].median("seconds")
            limit = max(direct, memory)
            rows = [
                f"### {title}: {nbytes / 1e9:.2f} GB in, {written / 1e9:.2f} GB written",
                "",
                "| tool | wall (median) | / max(O_DIRECT write, torch in memory) | peak RSS |",
                "|---|---|---|---|",
                *(_row(name, s, limit) for name, s in samples.items()),
                "",
            ]
            tables += rows
            print("\n".join(rows), flush=True)
    text = "\n".join(
        [
            SECTION,
            "",
            f"bf16 [{SHAPE[0]}, {SHAPE[1]}] tensors; medians of {args.repeat} runs, each a "
            "fresh process, interleaved, warm page cache for the input; weightmap's outputs "
            "compared bit for bit (through the page cache and past it"
            + (", and **before**" if args.baseline is not None else "")
            + (
                "; in each round **before** runs right after the direct-write job and its "
                "settling write, which is not always enough (section Direct writes)"
                if args.baseline is not None
                else ""
            )
            + f"). `{args.said}` ({time.strftime('%Y-%m-%d')}, "
            f"{os.uname().machine}, {os.cpu_count()} cores).",
            "",
            *tables,
        ]
    )
    if not args.no_write:
        write_section(SECTION, text)


def in_a_row(args: argparse.Namespace) -> None:
    """The cast, each variant's runs in a row: direct, before (if given), this commit's
    default, then direct again. Every run is listed, the first (untimed warm-up) apart."""
    rows: list[str] = []
    with _setup(args) as (launcher, workdir, src, nbytes):
        runner = Runner(workdir, launcher)
        mapping = workdir / "cast.wm"
        mapping.write_text(OPS["cast bf16 -> f32"][1])
        wm = ["weightmap", str(src), str(runner.out), "--mapping", str(mapping), "--torch"]
        order = [("past the page cache (`WEIGHTMAP_DIRECT_IO=1`)", "weightmap", [*wm, "--direct"])]
        if args.baseline is not None:
            order.append(("through the page cache, **before**", "before", wm))
        order.append(("through the page cache, this commit (the default)", "weightmap", wm))
        order.append(("past the page cache, again", "weightmap", [*wm, "--direct"]))
        for label, tool, argv in order:
            runs = []
            for _ in range(args.repeat + 1):
                runner.clean()
                warm(src)
                runs.append(runner.job(argv, tool=tool)["seconds"])
            shown = ", ".join(f"{t:.2f}" for t in runs[1:])
            rows.append(f"| {label} | {runs[0]:.2f} s | {shown} s |")
            print(rows[-1], flush=True)
        runner.clean()
    text = "\n".join(
        [
            "## Direct writes (O_DIRECT): runs of one kind in a row",
            "",
            f"The cast of {nbytes / 1e9:.2f} GB of bf16 to f32 ({2 * nbytes / 1e9:.2f} GB "
            "written, fsynced), each way of writing run "
            f"{args.repeat + 1} times in a row, in the order of the rows, a fresh process each, "
            "warm page cache for the input, no settling write. "
            f"`{args.said}` ({time.strftime('%Y-%m-%d')}, "
            f"{os.uname().machine}, {os.cpu_count()} cores).",
            "",
            "| writes | first run | the runs after it |",
            "|---|---|---|",
            *rows,
            "",
        ]
    )
    print(text)
    if not args.no_write:
        write_section("## Direct writes", text)


if __name__ == "__main__":
    main()
