"""The exception hierarchy: one root, one subclass per stage.

Every error weightmap raises for bad input derives from :class:`WeightmapError`, so a caller
can catch the whole family at once, and each stage's error also derives from the builtin a
caller would naturally expect (``ValueError`` for malformed data, ``OSError`` for I/O).
Messages name the file, the tensor or the rule, and what to do about it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

__all__ = [
    "Cancelled",
    "CheckpointError",
    "CompileError",
    "ExecutionError",
    "FormatError",
    "Loc",
    "MappingError",
    "MappingSyntaxError",
    "OutputExistsError",
    "PlanError",
    "Problem",
    "WeightmapError",
]


class _Frozen:
    """A small immutable value with ``__slots__``, compared and hashed by its fields: what a
    frozen dataclass gives, written out because ``dataclasses`` imports ``inspect`` (7 ms),
    and every command, ``--help`` included, imports this module."""

    __slots__: tuple[str, ...] = ()

    def __init__(self, *values: object) -> None:
        for name, value in zip(self.__slots__, values, strict=True):
            object.__setattr__(self, name, value)

    def _values(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"cannot assign to field {name!r} of a frozen {type(self).__name__}")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"cannot delete field {name!r} of a frozen {type(self).__name__}")

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__)
        return f"{type(self).__name__}({fields})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self._values())


class Loc(_Frozen):
    """A position in a mapping source: file name (or ``<string>``), 1-based line and column."""

    __slots__ = ("file", "line", "col")  # noqa: RUF023 (the constructor's order)
    file: str
    line: int
    col: int

    def __init__(self, file: str, line: int, col: int) -> None:
        super().__init__(file, line, col)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


class WeightmapError(Exception):
    """Root of every error that weightmap raises on purpose."""


class FormatError(WeightmapError, ValueError):
    """A safetensors file breaks a rule of the format.

    ``path`` is the offending file, ``tensor`` the tensor concerned (if any) and ``rule`` a short
    identifier of the broken rule (stable, for tests and tools). ``detail`` is the message alone,
    without the path, tensor and rule around it.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | Path | None = None,
        tensor: str | None = None,
        rule: str = "format",
    ) -> None:
        self.path = None if path is None else str(path)
        self.tensor = tensor
        self.rule = rule
        self.detail = message
        where = f"{self.path}: " if self.path else ""
        shown = repr(tensor) if tensor is None or len(tensor) <= 200 else repr(tensor[:200]) + "..."
        what = f"tensor {shown}: " if tensor is not None else ""
        super().__init__(f"{where}{what}{message} [{rule}]")

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled with its fields, not its text: rebuilt from the text alone, the path and the
        # rule would be quoted twice (an error raised in another process, e.g. a Ray task).
        return (_format_error, (type(self), self.detail, self.path, self.tensor, self.rule))


def _format_error(
    cls: type[FormatError], detail: str, path: str | None, tensor: str | None, rule: str
) -> FormatError:
    return cls(detail, path=path, tensor=tensor, rule=rule)


class CheckpointError(FormatError):
    """A checkpoint as a whole is inconsistent: index vs shards, missing files, bad config."""

    @classmethod
    def closed(cls, path: str | Path) -> CheckpointError:
        """A file of a checkpoint read after the checkpoint was closed (``closed``): its
        descriptor is gone, and its name is never opened again in its place."""
        return cls(
            "is closed: its checkpoint was closed before this read (read a checkpoint while it "
            "is open, in its `with` block)",
            path=str(path),
            rule="closed",
        )


class MappingSyntaxError(WeightmapError, ValueError):
    """A mapping file cannot be parsed. The message shows file:line:col and a caret."""


class MappingError(WeightmapError, ValueError):
    """A mapping parses but is wrong for itself or for the checkpoint (the plan stage)."""


# The plan stage is where mapping semantics are checked; one name for both.
PlanError = MappingError


class Problem(_Frozen):
    """One compile error at a location in a mapping."""

    __slots__ = ("loc", "message")
    loc: Loc
    message: str

    def __init__(self, loc: Loc, message: str) -> None:
        super().__init__(loc, message)

    def __str__(self) -> str:
        return f"{self.loc}: {self.message}"


class CompileError(MappingError):
    """Every problem found while compiling a mapping; ``problems`` lists them in order."""

    def __init__(self, problems: Sequence[Problem], mapping_name: str) -> None:
        self.problems = tuple(problems)
        n = len(self.problems)
        head = f"mapping {mapping_name!r} cannot be applied ({n} problem{'s' * (n != 1)}):"
        super().__init__("\n".join([head, *(f"  {p}" for p in self.problems)]))


class ExecutionError(WeightmapError, OSError):
    """Writing the output failed; the destination was left as it was."""


class Cancelled(WeightmapError):
    """Stopping was asked (``remap(..., cancel=...)``, ``iter_tensors(..., cancel=...)``, or a
    signal to the command line) and the run stopped at its next chunk: nothing was committed,
    temporaries were removed, and the destination was left as it was."""


class OutputExistsError(ExecutionError, FileExistsError):
    """The destination exists and the caller did not ask to overwrite it (or it is the input)."""


class LocatedProblem(Exception):
    """Internal: something wrong at a place in a mapping (an expression, a rule, a filter).

    Never reaches a user as it is: the compiler catches it and records a :class:`Problem`
    (``loc`` None means "the rule being applied"). Subclasses say which stage found it.
    """

    def __init__(self, message: str, loc: Loc | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.loc = loc
