"""Long-running fuzzer for weightmap's parsers (header, index/config, journal, mapping).

Runs the strategies of ``tests/strategies.py`` against the oracles of ``tests/test_fuzz.py``
with hypothesis, in chunks, until the time is up; prints the cases run per target, every
finding and the peak RSS, and exits 1 on a finding. A finding is any exception other than a
WeightmapError, a hang past the per-example alarm, or a MemoryError under the address-space
cap.

    python fuzz/fuzz_parsers.py --minutes 12 --target all
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import strategies
import test_fuzz as tf

TARGETS = ("header", "index", "journal", "mapping")
CHUNK = 200  # examples per hypothesis run; time is checked between runs
MEMORY_CAP = 4 * 2**30  # address space; a memory bomb becomes a MemoryError (a finding)


def build(
    folder: Path,
) -> dict[str, list[tuple[str, st.SearchStrategy[Any], Callable[[Any], Any]]]]:
    """Per target: (name, strategy, case function) triples."""
    sharded = tf.make_sharded(folder / "index" / "ckpt")
    single = folder / "config"
    single.mkdir()
    tf.write_safetensors(single / tf.SINGLE_NAME, {"a.weight": ("F32", [2, 2])})
    work = folder / "header"
    work.mkdir()
    journal = tf.make_journal_folder(folder / "journal" / "ckpt")
    includes = folder / "includes"
    includes.mkdir()
    configs = tf.config_mappings()
    base_specs, base_config = strategies.PROGRAMS[0][1], strategies.PROGRAMS[0][2]
    return {
        "header": [
            ("bytes", st.binary(max_size=2000), lambda d: tf.header_file_case(d, work)),
            (
                "prefix",
                st.tuples(st.integers(0, tf.U64_MAX), st.binary(max_size=400)),
                lambda t: tf.header_file_case(t[0].to_bytes(8, "little") + t[1], work),
            ),
            ("mutated", strategies.header_files(), lambda d: tf.header_file_case(d, work)),
        ],
        "index": [
            ("index", strategies.index_docs(), lambda d: tf.index_case(d, sharded)),
            ("config", strategies.config_docs(), lambda d: tf.config_case(d, single, configs)),
        ],
        "journal": [
            ("journal", strategies.journal_docs(), lambda d: tf.journal_case(d, journal)),
        ],
        "mapping": [
            ("text", st.text(max_size=400), lambda t: tf.mapping_case(t, base_specs, base_config)),
            (
                "bytes",
                st.binary(max_size=400),
                lambda d: tf.mapping_case(
                    "weightmap 1\n" + d.decode("utf-8", "surrogateescape"), base_specs, base_config
                ),
            ),
            ("mutated", strategies.mutated_programs(), lambda c: tf.mapping_case(*c)),
            ("params", strategies.params_cases(), lambda c: tf.mapping_case(*c)),
            ("includes", strategies.include_trees(), lambda f: tf.include_case(f, includes)),
            ("set", strategies.set_values(), tf.set_case),
        ],
    }


def run_chunk(
    strategy: st.SearchStrategy[Any], case: Callable[[Any], Any], counter: list[int]
) -> None:
    """One hypothesis run of CHUNK examples; raises the (shrunk) finding, if any."""

    @settings(
        max_examples=CHUNK,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate, Phase.shrink],
    )
    @given(value=strategy)
    def fuzz(value: Any) -> None:
        counter[0] += 1
        case(value)

    fuzz()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="total run time")
    parser.add_argument("--target", choices=[*TARGETS, "all"], default="all")
    args = parser.parse_args(argv)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))

    targets = TARGETS if args.target == "all" else (args.target,)
    counts: Counter[str] = Counter()
    findings: list[str] = []
    start = time.monotonic()
    deadline = start + args.minutes * 60
    with tempfile.TemporaryDirectory(prefix="weightmap-fuzz-") as tmp:
        plan = build(Path(tmp))
        jobs = [(t, *job) for t in targets for job in plan[t]]
        i = 0
        while time.monotonic() < deadline:
            target, name, strategy, case = jobs[i % len(jobs)]
            i += 1
            counter = [0]
            try:
                run_chunk(strategy, case, counter)
            except Exception as exc:  # a finding: report it and keep fuzzing
                text = "".join(traceback.format_exception(exc))
                findings.append(f"[{target}/{name}] {type(exc).__name__}: {exc}\n{text}")
                print(f"FINDING [{target}/{name}] {type(exc).__name__}: {exc}", flush=True)
            counts[target] += counter[0]
            counts[f"{target}/{name}"] += counter[0]
            if i % len(jobs) == 0:
                elapsed = time.monotonic() - start
                done = ", ".join(f"{t} {counts[t]}" for t in targets)
                print(f"{elapsed:7.0f} s: {done}", flush=True)

    elapsed = time.monotonic() - start
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\nran {elapsed / 60:.1f} min")
    for key in sorted(counts):
        print(f"  {key:20} {counts[key]:>10} cases")
    print(f"  total                {sum(counts[t] for t in targets):>10} cases")
    print(f"peak RSS: {peak_mib:.0f} MiB")
    print(f"findings: {len(findings)}")
    for f in findings:
        print(f)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
