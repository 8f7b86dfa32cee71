"""config.json edits: the statements of a ``config { ... }`` block, applied in order.

Paths are tuples of object keys inside the config and nothing else: an edit can only read and
write fields of the config object it is given (there is no way to name a file or a parent).
Inside a block, ``config`` means the config as edited so far.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from weightmap.format.text import MAX_JSON_DEPTH
from weightmap.language import ast as A
from weightmap.language.expr import compile_expr
from weightmap.language.values import EvalError, Scope, equal, truth

__all__ = ["apply_config_block"]

Report = Callable[[A.Loc, str], None]


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(path)


def _parent(cfg: dict[str, Any], path: tuple[str, ...], create: bool) -> dict[str, Any] | str:
    """The object holding ``path[-1]``, or an error message."""
    if len(path) > MAX_JSON_DEPTH:
        # No config.json can hold it (see text.MAX_JSON_DEPTH), and walking or comparing
        # objects that deep would overflow Python's stack.
        return f"`{_dotted(path[:3])}...` is {len(path)} fields deep; at most {MAX_JSON_DEPTH}"
    obj = cfg
    for i, key in enumerate(path[:-1]):
        if key not in obj:
            if not create:
                return f"`{_dotted(path[: i + 1])}` is missing from the config"
            obj[key] = {}
        nxt = obj[key]
        if not isinstance(nxt, dict):
            return (
                f"`{_dotted(path[: i + 1])}` is not an object, so it has no field `{path[i + 1]}`"
            )
        obj = nxt
    return obj


def apply_config_block(
    block: A.ConfigBlock, cfg: dict[str, Any], scope: Scope, report: Report
) -> None:
    """Apply ``block`` to ``cfg`` in place; every problem goes to ``report``."""
    _run(block.stmts, cfg, scope, report)


def _cond(e: A.Expr, scope: Scope, report: Report) -> bool | None:
    try:
        return truth(compile_expr(e)(scope), e.loc)
    except EvalError as err:
        report(err.loc, err.message)
        return None


def _run(stmts: tuple[A.CfgStmt, ...], cfg: dict[str, Any], scope: Scope, report: Report) -> None:
    # Every block of a compile, and every branch inside one, spends the same budget: a value
    # built in one block is carried by the config into the next.
    here = Scope(scope.params, cfg, {}, None, scope.exists, budget=scope.budget)
    for st in stmts:
        if isinstance(st, A.CfgIf):
            ok = _cond(st.cond, here, report)
            if ok is not None:
                _run(st.then if ok else st.orelse, cfg, scope, report)
        elif isinstance(st, A.CfgSet):
            try:
                value = compile_expr(st.value)(here)
                # What a field receives counts against the work limit as any built value does:
                # `b = config` copies the whole config, and a few such lines in a row would
                # double it each time (the charge also refuses a value nested too deep to copy).
                here.charge_value(value, st.value.loc)
                value = copy.deepcopy(value)
            except EvalError as err:
                report(err.loc, err.message)
                continue
            parent = _parent(cfg, st.path, create=True)
            if isinstance(parent, str):
                report(st.loc, f"cannot set `{_dotted(st.path)}`: {parent}")
            else:
                parent[st.path[-1]] = value
        elif isinstance(st, A.CfgDelete):
            if st.cond is not None and not _cond(st.cond, here, report):
                continue
            for path in st.paths:
                parent = _parent(cfg, path, create=False)
                if isinstance(parent, dict) and path[-1] in parent:
                    del parent[path[-1]]
                elif not st.optional:
                    report(
                        st.loc,
                        f"cannot delete `{_dotted(path)}`: it is missing from the config"
                        " (write `delete?` if it may be absent)",
                    )
        elif isinstance(st, A.CfgMove):
            _move(st, cfg, report)
        elif isinstance(st, A.CfgNest):
            _nest(st, cfg, report)
        else:
            _lift(st, cfg, report)


def _move(st: A.CfgMove, cfg: dict[str, Any], report: Report) -> None:
    src_parent = _parent(cfg, st.src, create=False)
    if not isinstance(src_parent, dict) or st.src[-1] not in src_parent:
        report(st.loc, f"cannot move `{_dotted(st.src)}`: it is missing from the config")
        return
    if st.dst[: len(st.src)] == st.src and len(st.dst) > len(st.src):
        # The destination would hang inside the object being moved, and popping it off the
        # config would take the destination with it: the field would silently vanish.
        report(
            st.loc,
            f"cannot move `{_dotted(st.src)}` into itself (`{_dotted(st.dst)}`): move it to a"
            f" new name first, or `nest` the fields that should go inside it",
        )
        return
    dst_parent = _parent(cfg, st.dst, create=True)
    if isinstance(dst_parent, str):
        report(st.loc, f"cannot move to `{_dotted(st.dst)}`: {dst_parent}")
    elif st.dst[-1] in dst_parent:
        report(st.loc, f"cannot move to `{_dotted(st.dst)}`: it exists (delete it first)")
    else:
        dst_parent[st.dst[-1]] = src_parent.pop(st.src[-1])


def _nest(st: A.CfgNest, cfg: dict[str, Any], report: Report) -> None:
    parent = _parent(cfg, st.path, create=False)
    name = _dotted(st.path)
    if isinstance(parent, str):
        report(st.loc, f"cannot nest into `{name}`: {parent}")
        return
    if st.path[-1] in parent:
        report(st.loc, f"cannot nest into `{name}`: it exists (delete or lift it first)")
        return
    keep = set(st.keep)
    inner = {k: v for k, v in parent.items() if k not in keep}
    for k in inner:
        del parent[k]
    parent[st.path[-1]] = inner


def _lift(st: A.CfgLift, cfg: dict[str, Any], report: Report) -> None:
    parent = _parent(cfg, st.path, create=False)
    name = _dotted(st.path)
    if not isinstance(parent, dict) or st.path[-1] not in parent:
        report(st.loc, f"cannot lift `{name}`: it is missing from the config")
        return
    inner = parent[st.path[-1]]
    if not isinstance(inner, dict):
        report(st.loc, f"cannot lift `{name}`: it is not an object")
        return
    # JSON equality, as `==` in the language: `true` beside a lifted `1` is a clash.
    clashes = sorted(
        k for k, v in inner.items() if k in parent and k != st.path[-1] and not equal(parent[k], v)
    )
    if clashes and not st.overwrite:
        report(
            st.loc,
            f"cannot lift `{name}`: its fields {', '.join(clashes)} differ from fields already"
            f" beside it (write `lift {name} overwrite` to let the lifted values win,"
            " or delete them first)",
        )
        return
    del parent[st.path[-1]]
    parent.update(inner)
