"""What each tensor rule makes of the inputs it matched: output names and operation trees.

Every check that needs shapes and dtypes lives here (split sizes, merge groups, casts...).
A failure raises :class:`RuleProblem`; the compiler records it against the rule's location
and carries on with the next match, so that one run reports every problem.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from weightmap.compiler.names import MAX_NAME_CHARS
from weightmap.errors import LocatedProblem
from weightmap.format.dtypes import DTYPES, TensorSpec, numel
from weightmap.language import ast as A
from weightmap.language.expr import (
    capture_format,
    compile_expr,
    compile_template,
    resolve_dtype,
)
from weightmap.language.values import EvalError, Scope, brief
from weightmap.plan.nodes import Cast, Node, Permute, Reshape, Slice

__all__ = [
    "FLOAT_CASTS",
    "INT_CASTS",
    "Match",
    "RuleProblem",
    "as_int",
    "as_ints",
    "build_simple",
    "check_cast",
    "evaluate",
    "namer",
    "output_name",
    "tensor_namer",
]

# Floating types torch converts between (round to nearest even); integer widths likewise.
FLOAT_CASTS = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
INT_CASTS = frozenset({"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"})


class RuleProblem(LocatedProblem):
    """A rule cannot be applied to a match; ``loc`` is None for the rule's own location."""


class Match(NamedTuple):
    """A tensor a rule took from the working set: its current name, dtype and shape, the node
    that computes it, the pattern's captures and which of the rule's patterns matched.

    A tuple, not a dataclass: one is made per tensor and hop, 100,000s per compile.
    """

    spec: TensorSpec
    node: Node
    caps: dict[str, Any]
    pattern_index: int


def evaluate(e: A.Expr, scope: Scope) -> Any:
    """Evaluate, turning expression errors into RuleProblems at the expression."""
    try:
        return compile_expr(e)(scope)
    except EvalError as err:
        raise RuleProblem(err.message, err.loc) from None


def as_int(v: Any, what: str) -> int:
    """``v`` as an int, or a RuleProblem naming ``what``."""
    if not isinstance(v, int) or isinstance(v, bool):
        raise RuleProblem(f"{what} must be an integer, got {brief(v)}")
    return v


def as_ints(v: Any, what: str) -> list[int]:
    """``v`` as a list of ints."""
    if not isinstance(v, list):
        example = f"{what} [{brief(v)}, ...]" if isinstance(v, int) else f"{what} [0, 1]"
        raise RuleProblem(
            f"{what} must be a list of integers, got {brief(v)}; write the list in brackets: "
            f"{example}"
        )
    return [as_int(x, what) for x in v]


def norm_dim(d: int, rank: int, name: str, extra: int = 0) -> int:
    """A dimension index, negatives counting from the end; ``extra`` = 1 for a new axis."""
    size = rank + extra
    if not -size <= d < size:
        raise RuleProblem(f"dim {d} is out of range for {name} with {rank} dimension(s)")
    return d % size


def check_cast(src: str, dst: str) -> str | None:
    """Why ``src`` cannot be cast to ``dst``, or None if it can."""
    if src == dst or (src in FLOAT_CASTS and dst in FLOAT_CASTS):
        return None
    if src in INT_CASTS | FLOAT_CASTS and dst in INT_CASTS | FLOAT_CASTS:
        # Integer <-> float too: a float cast to an integer must hold whole numbers in range
        # (checked as the data is read), so a quantized format's codes and their arithmetic
        # in float meet explicitly, never by a silent conversion.
        return None
    return (
        f"cannot cast {src} to {dst}: casts go between the float types "
        f"({', '.join(sorted(FLOAT_CASTS))}) and the integer types"
    )


def build_simple(rule: A.Rule, m: Match, scope: Scope, emit: Callable[[str, Node], None]) -> None:
    """Apply a one-input rule (everything but drop, merge and stack) to one match."""
    spec = m.spec
    src = m.node
    s = scope.with_tensor(spec, m.caps)
    op = rule.op
    if op in ("keep", "rename"):  # most rules, and every tensor of a large checkpoint: short
        emit(output_name(rule, s), src)
        return
    rank, name = len(spec.shape), f"`{spec.name}` {list(spec.shape)}"
    if op == "copy":
        for t in rule.outputs:
            emit(namer(t)(s), src)
    elif op == "cast":
        dst = resolve_dtype(rule.to_dtype or "") or ""
        if dst == spec.dtype:
            emit(output_name(rule, s), src)
        else:
            why = check_cast(spec.dtype, dst)
            if why:
                raise RuleProblem(f"{name}: {why}")
            emit(output_name(rule, s), Cast(dtype=dst, shape=spec.shape, src=src))
    elif op in ("transpose", "permute"):
        _permute(rule, s, src, rank, name, emit)
    elif op == "reshape":
        _reshape(rule, s, src, name, emit)
    elif op in ("split", "chunk"):
        d = norm_dim(as_int(evaluate(rule.dim, s), "dim"), rank, name)  # type: ignore[arg-type]
        if op == "split":
            sizes = as_ints(evaluate(rule.sizes, s), "sizes")  # type: ignore[arg-type]
            if len(sizes) != len(rule.outputs):
                raise RuleProblem(f"{len(sizes)} sizes for {len(rule.outputs)} outputs")
            if any(x <= 0 for x in sizes):
                raise RuleProblem(
                    f"split sizes {sizes} must all be positive: an output of size 0 or less "
                    "holds nothing (drop it from the outputs)"
                )
            if sum(sizes) != spec.shape[d]:
                raise RuleProblem(
                    f"split sizes {sizes} (sum {sum(sizes)}) do not add up to dim {d} of {name}"
                )
        elif rule.parts is not None:
            # `chunk ... into n -> "t"`: n pieces, each named by the template's one new name
            # (the piece's index), as unstack names its slices: a scatter into ranks.
            if len(rule.outputs) != 1:
                raise RuleProblem(
                    f"chunk ... into n names its pieces by one template with the index, e.g. "
                    f'-> "out:{{r}}:{{x}}"; this one has {len(rule.outputs)}'
                )
            parts = as_int(evaluate(rule.parts, s), "into")
            if not 1 <= parts <= MAX_PARTS:
                raise RuleProblem(f"chunk into {parts} pieces: give 1 to {MAX_PARTS}")
            if spec.shape[d] % parts:
                raise RuleProblem(f"dim {d} of {name} does not divide into {parts} equal chunks")
            sizes = [spec.shape[d] // parts] * parts
        else:
            parts = len(rule.outputs)
            if spec.shape[d] % parts:
                raise RuleProblem(f"dim {d} of {name} does not divide into {parts} equal chunks")
            sizes = [spec.shape[d] // parts] * parts
        if rule.parts is not None:
            var = unstack_var(rule, set(m.caps), set(scope.params), "chunk ... into")
            tmpl = namer(rule.outputs[0])
            names = [tmpl(scope.with_tensor(spec, {**m.caps, var: i})) for i in range(parts)]
        else:
            names = [namer(t)(s) for t in rule.outputs]
        start = 0
        for i, size in enumerate(sizes):
            shape = (*spec.shape[:d], size, *spec.shape[d + 1 :])
            node = Slice(
                dtype=spec.dtype, shape=shape, src=src, dim=d, start=start, stop=start + size
            )
            emit(names[i], node)
            start += size
    elif op == "unstack":
        d = norm_dim(as_int(evaluate(rule.dim, s), "dim") if rule.dim else 0, rank, name)
        var = unstack_var(rule, set(m.caps), set(scope.params))
        tmpl = namer(rule.outputs[0])
        shape = spec.shape[:d] + spec.shape[d + 1 :]
        for i in range(spec.shape[d]):
            piece_shape = (*spec.shape[:d], 1, *spec.shape[d + 1 :])
            piece = Slice(dtype=spec.dtype, shape=piece_shape, src=src, dim=d, start=i, stop=i + 1)
            out = tmpl(scope.with_tensor(spec, {**m.caps, var: i}))
            emit(out, Reshape(dtype=spec.dtype, shape=shape, src=piece))


_TEMPLATES: dict[int, tuple[A.Template, Callable[[Scope], str]]] = {}


# Pieces of one `chunk ... into n`: as many as a family has members (compiler/outputs.py).
MAX_PARTS = 4096


def namer(t: A.Template) -> Callable[[Scope], str]:
    """The compiled renderer of an output name's template, compiled once (keyed by identity,
    kept alive); a name past ``MAX_NAME_CHARS`` is refused as it is made."""
    hit = _TEMPLATES.get(id(t))
    if hit is None or hit[0] is not t:
        render = compile_template(t)

        def checked(scope: Scope) -> str:
            return short_enough(render(scope))

        hit = _TEMPLATES[id(t)] = (t, checked)
    return hit[1]


def short_enough(name: str) -> str:
    """``name``, or a ``RuleProblem`` where it is longer than any output name may be: refused
    as each is made, not once every output is (a template that renders 400 KB per tensor would
    otherwise hold gigabytes for a checkpoint of a few thousand tensors)."""
    if len(name) > MAX_NAME_CHARS:
        raise RuleProblem(f"output name {name[:80]!r} is longer than {MAX_NAME_CHARS} characters")
    return name


def tensor_namer(t: A.Template, scope: Scope) -> Callable[[TensorSpec, dict[str, Any]], str]:
    """The template rendered for a tensor and its captures in ``scope``.

    Where every hole is a bare name (``"layers.{i}.{rest}"``), straight from the captures,
    with no scope made per tensor: a rename of every tensor of a 100,000-tensor checkpoint
    is the most common plan there is. Otherwise, and for a hole that is no capture (a param),
    through ``scope.with_tensor``, as ``namer`` renders it.
    """
    render = namer(t)
    fmt = capture_format(t)
    if fmt is None or scope.local:

        def through_scope(spec: TensorSpec, caps: dict[str, Any]) -> str:
            return render(scope.with_tensor(spec, caps))

        return through_scope

    def from_captures(spec: TensorSpec, caps: dict[str, Any]) -> str:
        try:
            return short_enough(fmt.format_map(caps))
        except KeyError:  # a hole that is no capture: a param
            return render(scope.with_tensor(spec, caps))

    return from_captures


def output_name(rule: A.Rule, s: Scope) -> str:
    """The rule's output name for this tensor: its template, or the tensor's own name."""
    if not rule.outputs:
        assert s.tensor is not None
        return s.tensor.name
    return namer(rule.outputs[0])(s)


def _permute(
    rule: A.Rule, s: Scope, src: Node, rank: int, name: str, emit: Callable[[str, Node], None]
) -> None:
    if rule.op == "transpose":
        if rule.dims is None:
            if rank != 2:
                raise RuleProblem(f"{name} has {rank} dimensions; say which two: dims [a, b]")
            a, b = 0, 1
        else:
            pair = as_ints(evaluate(rule.dims, s), "dims")
            if len(pair) != 2:
                raise RuleProblem(f"transpose takes two dims, got {pair}")
            a, b = (norm_dim(x, rank, name) for x in pair)
        perm = list(range(rank))
        perm[a], perm[b] = perm[b], perm[a]
    else:
        perm = as_ints(evaluate(rule.dims, s), "dims")  # type: ignore[arg-type]
        if sorted(perm) != list(range(rank)):
            raise RuleProblem(f"dims {perm} is not an ordering of the {rank} dimensions of {name}")
    shape = tuple(src.shape[p] for p in perm)
    emit(output_name(rule, s), Permute(dtype=src.dtype, shape=shape, src=src, perm=tuple(perm)))


def _reshape(
    rule: A.Rule, s: Scope, src: Node, name: str, emit: Callable[[str, Node], None]
) -> None:
    if rule.from_shape is not None:
        expect = as_ints(evaluate(rule.from_shape, s), "from shape")
        if tuple(expect) != src.shape:
            raise RuleProblem(f"{name} does not have the declared shape {expect}")
    target = as_ints(evaluate(rule.to_shape, s), "shape")  # type: ignore[arg-type]
    if target.count(-1) > 1 or any(x < -1 for x in target):
        raise RuleProblem(f"shape {target}: sizes are >= 0, with at most one -1")
    known = numel(tuple(x for x in target if x != -1))
    total = numel(src.shape)
    if -1 in target:
        if known == 0 or total % known:
            raise RuleProblem(f"cannot reshape {name} to {target}")
        target[target.index(-1)] = total // known
    if numel(tuple(target)) != total:
        raise RuleProblem(f"cannot reshape {name} ({total} elements) to {target}")
    emit(output_name(rule, s), Reshape(dtype=src.dtype, shape=tuple(target), src=src))


def template_names(t: A.Template) -> set[str]:
    """The bare names a template's holes read (captures, params, unstack indexes)."""
    out: set[str] = set()

    def walk(e: Any) -> None:
        if isinstance(e, A.Name):
            out.add(e.id)
        elif isinstance(e, (A.Lit, A.Exists, A.ConfigRef)) or e is None:
            return
        elif isinstance(e, A.Comp):
            walk(e.elt)
            walk(e.iterable)
            walk(e.cond)
            out.discard(e.var)
        elif isinstance(e, A.DictExpr):
            for _k, v in e.items:
                walk(v)
        else:
            for f in ("obj", "index", "operand", "left", "right"):
                walk(getattr(e, f, None))
            for x in getattr(e, "args", ()) or getattr(e, "items", ()):
                walk(x)

    for part in t.parts:
        if not isinstance(part, str):
            walk(part)
    return out


def unstack_var(rule: A.Rule, caps: set[str], params: set[str], what: str = "an unstack") -> str:
    """The one name in an unstack (or ``chunk ... into``) template that is neither a capture
    nor a param: the piece's index."""
    free = sorted(template_names(rule.outputs[0]) - caps - params)
    if len(free) != 1:
        raise RuleProblem(
            f"{what} output needs exactly one new name for the index, e.g. "
            f'"experts.{{e}}.weight"; found {free or "none"}'
        )
    return free[0]


def dtype_known(word: str | None) -> bool:
    """True when ``word`` names a safetensors dtype."""
    return word is not None and resolve_dtype(word) in DTYPES
