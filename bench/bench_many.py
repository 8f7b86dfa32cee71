"""A rename of 200,000 small tensors in 8 shards against ``cp -r`` + fsync, side by side.

    python bench/bench_many.py [--tensors 200000] [--shards 8] [--repeat 5]
                               [--baseline SRC [--baseline-name REV]]
                               [--workdir DIR] [--no-write]

The cost of such a conversion is per tensor (reading headers, compiling, laying out the
shards, writing the index), not per byte: MoE checkpoints of the DeepSeek-V3 and Kimi-K2 class
hold 90,000 to 150,000 tensors with their scales. Every tensor is a bf16 [32, 64] expert
projection (4 KiB), renamed ``model.layers.{n}.mlp.experts.{rest}`` -> ``layers.{n}.experts.
{rest}``. Each run is a fresh process (``bench/_job.py``, through the launcher of
``bench/jobs.py``, interleaved, warm page cache, output deleted and synced between runs);
``--baseline SRC`` adds a **before** column importing weightmap from another tree's ``src/``
(e.g. one unpacked with ``git archive``; ``--baseline-name`` says which commit it is in the
report, where the default is the tree's path). Writes the section "Many tensors at scale" of
docs/benchmarks.md (``--no-write``: print it only): a table of medians, the operation's time,
the whole process's, their ratios to ``cp -r`` + fsync, and the peak RSS with what it grew by
per tensor during the conversion (``ru_maxrss`` after, less before, over the tensors), and
the operation's time split into opening the checkpoint, compiling the plan and the rest; and
its CPU time (user + system) beside cp's, with the least wall time that CPU time allows when
spread perfectly over the machine's cores (what no scheduling of the same work can beat).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import time
from pathlib import Path

from common import command_line, scratch
from jobs import SOURCES, Launcher, Runner, Samples
from sections import write_section

SECTION = "## Many tensors at scale"

MAPPING = (
    'weightmap 1\nrename "model.layers.{n}.mlp.experts.{rest*}" -> "layers.{n}.experts.{rest}"\n'
)
_SHAPE = [32, 64]
_NBYTES = 32 * 64 * 2
# Tensors per layer (the names' layer number changes every so many).
_PER_LAYER = 4000


def write_many(folder: Path, tensors: int, shards: int) -> int:
    """The checkpoint: ``tensors`` bf16 tensors in ``shards`` shards and an index, filled with a
    repeated random block (every byte written: ``cp`` cannot skip holes). Returns its bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    block = os.urandom(1 << 20)
    weight_map: dict[str, str] = {}
    total = 0
    per = -(-tensors // shards)
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header: dict[str, object] = {}
        for offset, k in enumerate(range(s * per, min(tensors, (s + 1) * per))):
            layer, j = divmod(k, _PER_LAYER)
            tensor = f"model.layers.{layer}.mlp.experts.{j // 4}.w{j % 4}.weight"
            begin = offset * _NBYTES
            header[tensor] = {
                "dtype": "BF16",
                "shape": _SHAPE,
                "data_offsets": [begin, begin + _NBYTES],
            }
            weight_map[tensor] = name
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        data = len(header) * _NBYTES
        with (folder / name).open("wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for start in range(0, data, len(block)):
                f.write(block[: min(len(block), data - start)])
        total += 8 + len(raw) + data
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def _row(name: str, s: Samples, cp: Samples, tensors: int) -> str:
    seconds, process = s.median("seconds"), s.median("process")
    grown = (s.median("rss_peak") - s.median("rss_base")) * 1024 / tensors
    # Where the operation's time goes: opening the checkpoint (headers, index), compiling,
    # and the rest (laying out, copying, writing the index, fsync).
    opened, compiled = s.median("open"), s.median("compile")
    rest = seconds - opened - compiled
    return (
        f"| {name} | {seconds:.3f} s | {process:.3f} s | {seconds / cp.median('seconds'):.2f}x "
        f"| {process / cp.median('process'):.2f}x | {s.median('cpu'):.3f} s "
        f"| {s.median('rss_peak'):,.0f} MiB "
        f"| {grown:.2f} KiB | {opened:.3f} / {compiled:.3f} / {rest:.3f} s |"
    )


def _floor(s: Samples, cp: Samples) -> str:
    """What the operation's CPU time alone allows: spread perfectly over every core, the
    least wall time it could take, as a ratio to cp's."""
    cores = os.cpu_count() or 1
    least = s.median("cpu") / cores
    return (
        f"weightmap's CPU time alone (user + system, {s.median('cpu'):.3f} s), spread perfectly "
        f"over the {cores} cores, would take {least:.3f} s: {least / cp.median('seconds'):.2f}x "
        "cp's whole run, before any wait on the disk."
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=200_000)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--baseline", type=Path, help="a src/ tree to run as the before column")
    p.add_argument("--baseline-name", help="what the report calls the before tree (its commit)")
    p.add_argument("--workdir", type=Path, help="scratch folder (default: a temporary one)")
    p.add_argument("--no-write", action="store_true", help="print the section only")
    args = p.parse_args()
    launcher = Launcher()  # (started before anything heavy: see bench/jobs.py)
    workdir = scratch("weightmap-many-", args.workdir)
    try:
        src = workdir / "many"
        nbytes = write_many(src, args.tensors, args.shards)
        mapping = workdir / "rename.wm"
        mapping.write_text(MAPPING)
        runner = Runner(workdir, launcher)
        out = str(runner.out)
        tools = {"weightmap": ["weightmap", str(src), out, "--mapping", str(mapping)]}
        if args.baseline is not None:
            SOURCES["before"] = args.baseline.resolve()
            tools["before"] = tools["weightmap"]
        tools["cp -r + fsync"] = ["cp", str(src), out, "--fsync"]
        samples = runner.compare(
            {name: (lambda a=a: a) for name, a in tools.items()}, [src], args.repeat
        )
    finally:
        launcher.close()
        shutil.rmtree(workdir, ignore_errors=True)
    cp = samples["cp -r + fsync"]
    lines = [
        SECTION,
        "",
        f"{args.tensors:,} bf16 [32, 64] tensors in {args.shards} shards, "
        f"{nbytes / 1e9:.2f} GB, every tensor renamed; medians of {args.repeat} runs, each a "
        "fresh process, interleaved, warm page cache"
        + (
            f"; **before** imports weightmap from `{args.baseline_name or args.baseline}`"
            if args.baseline
            else ""
        )
        + f". `{command_line('bench_many.py', p, args)}` ({time.strftime('%Y-%m-%d')}, "
        f"{os.uname().machine}, {os.cpu_count()} cores).",
        "",
        "| tool | operation | whole process | operation / cp | process / cp "
        "| CPU (user + system) | peak RSS | RSS grown per tensor | open / compile / the rest |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in samples.items():
        if s.failures:
            lines.append(f"| {name} | failed: {s.failures[0]} | | | | | | | |")
        elif name == "cp -r + fsync":
            lines.append(
                f"| {name} | {s.median('seconds'):.3f} s | {s.median('process'):.3f} s "
                f"| 1.00x | 1.00x | {s.median('cpu'):.3f} s | {s.median('rss_peak'):,.1f} MiB "
                "| | |"
            )
        else:
            lines.append(_row(name, s, cp, args.tensors))
    lines += [
        "",
        "**open** reads the shards' headers and the index and checks them against each other; "
        "**compile** matches every name against the mapping and makes the new ones; **the "
        "rest** lays out the shards, copies the data (two threads) while the main thread "
        "makes and writes the headers and the index, and fsyncs. A rename of every tensor goes "
        "through these stages as columns (names, dtypes, shapes, offsets), with no object made per "
        "tensor: what is left is the per-tensor work of the Python that reads, matches and "
        "writes the names, most of it before the first byte is copied.",
        "",
        "**CPU** is the operation's user and system time (cp's: the cp process's; the kernel "
        "threads that write dirty pages back to the disk are counted for neither). "
        + ("" if samples["weightmap"].failures else _floor(samples["weightmap"], cp)),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
