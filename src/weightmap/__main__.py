"""The ``weightmap`` command and ``python -m weightmap``: the command line of ``weightmap.cli``,
with a Ctrl-C that comes before the command runs ending quietly.

The command line handles Ctrl-C itself once a command runs (``weightmap.cli.run``). Before
that, while Python imports it and parses the arguments (50 to 100 ms, longer on a cold disk),
Python's default handler turns Ctrl-C into a KeyboardInterrupt, which would end the command
with a traceback. Nothing has been read or written by then: it says so, and exits with 130
as any other interrupted command does. This module imports nothing but ``sys`` before that point.
"""

import sys

# What a shell reports for a command that SIGINT stopped (128 + 2), as weightmap.cli does.
_INTERRUPTED = 130
_NOT_STARTED = "weightmap: interrupted before it started; nothing was done"


def _not_started() -> int:
    """Say that a Ctrl-C came before the command started; its exit code."""
    try:
        sys.stderr.write(f"\n{_NOT_STARTED}\n")
        sys.stderr.flush()
    except (OSError, ValueError, KeyboardInterrupt):
        pass  # (a closed stderr, or a second Ctrl-C: the exit code still says it)
    return _INTERRUPTED


def main() -> int:
    """Run the command line with ``sys.argv``; returns the exit code."""
    try:
        from weightmap.cli import parse, run

        # (Its own handlers are set once the command runs: until then, the Ctrl-C is ours.)
        args = parse()
    except KeyboardInterrupt:
        return _not_started()
    return run(args, final=True)  # (ends the process as the command ends)


if __name__ == "__main__":
    sys.exit(main())
