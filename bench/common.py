"""What every bench module shares: where things are, the units, and the progress log.

Nothing heavy is imported here (nor in any bench module at import time): ``bench/run.py``
starts its job launcher before numpy, torch or weightmap are loaded, see ``jobs.Launcher``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# What run.py itself imports of weightmap (the plans its checks compare with, the defaults the
# report names) comes from this checkout, as every job's does, whatever else is installed.
sys.path.insert(0, str(ROOT / "src"))
GB = 10**9
MIB = 2**20


def log(msg: str) -> None:
    """A timestamped progress line on stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


_COMPILED: set[Path] = set()


def compile_tree(src: Path) -> None:
    """Compile a source tree to bytecode once, as an installed package has it (pip compiles at
    install): where PYTHONDONTWRITEBYTECODE is set, every job would otherwise compile every
    module it imports, tens of milliseconds that no user pays."""
    if src in _COMPILED:
        return
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(src)], check=True, stdout=subprocess.DEVNULL
    )
    _COMPILED.add(src)


def scratch(prefix: str, workdir: Path | None) -> Path:
    """A new scratch folder for one bench run, inside ``workdir`` (made if it is missing) or
    the system's temporary folder."""
    import tempfile

    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=workdir))


# Options a report does not repeat in its command line: where scratch files went, whether the
# report was written, and which tree ran as the baseline (a local path; the report names it).
_UNSAID = frozenset({"workdir", "no_write", "baseline", "baseline_name", "help"})


def command_line(script: str, parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """``python bench/SCRIPT`` with the options this run gave other than their defaults (the
    number of runs among them), for a report to say how its figures were made."""
    words = [f"python {HERE.name}/{script}"]
    for action in parser._actions:
        if not action.option_strings or action.dest in _UNSAID:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default or value is None or value is False:
            continue
        option = max(action.option_strings, key=len)
        words.append(option if value is True else f"{option} {value}")
    return " ".join(words)
