"""Hypothesis strategies for the rule language, drawn from the grammar itself."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.extra.lark import from_lark
from lark import Lark

from weightmap.format.dtypes import TensorSpec
from weightmap.language.resources import read_text

# Terminals whose regexes would otherwise produce mostly noise: realistic words instead, so
# that generated programs reach the compiler, not only the parser.
NAMES = st.sampled_from(["i", "n", "e", "x", "layout", "dtype", "shape", "name", "f32", "bf16",
                         "len", "has", "min", "hidden_size", "a", "b"])  # fmt: skip
STRINGS = st.sampled_from([
    '"a.weight"', '"b.weight"', '"layers.{n:int}.{rest*}"', '"layers.{n}.w"', '"{x}.weight"',
    '"out.{x}"', '"out.{n - 1}.{rest}"', '"*"', '"**"', '"l.{i}.{gate,up}"', '"e.{e:int}"',
    '"msg {config.hidden_size}"', '"a.{x"', '"{x:a,b}"', '"x"', '""',
])  # fmt: skip


def programs() -> st.SearchStrategy[str]:
    """Source texts generated from grammars/weightmap.lark (most parse, some do not)."""
    grammar = Lark(read_text("grammars", "weightmap.lark"), parser="lalr", start="start")
    return from_lark(
        grammar,
        start="start",
        explicit={
            "NAME": NAMES,
            "STRING": STRINGS,
            "INT": st.sampled_from(["0", "1", "2", "3"]),
            "FLOAT": st.just("1.5"),
            "WS": st.just(" "),
            "COMMENT": st.just("# c\n"),
        },
    )


HEADERS = (
    TensorSpec("a.weight", "F32", (4, 4)),
    TensorSpec("b.weight", "BF16", (4, 2)),
    TensorSpec("layers.0.w", "F32", (2, 3)),
    TensorSpec("layers.1.w", "F32", (2, 3)),
    TensorSpec("l.0.gate", "F16", (2, 2)),
    TensorSpec("l.0.up", "F16", (2, 2)),
    TensorSpec("e.0", "I64", (3,)),
    TensorSpec("e.1", "I64", (3,)),
)
CONFIG = {"hidden_size": 4, "a": [1, 2], "b": {"c": None}}
