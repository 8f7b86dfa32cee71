"""Properties: generated programs compile or fail with our own errors; unparse round trips."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from strategies import CONFIG, HEADERS, grammar_programs
from weightmap.compiler.compile import compile_plan
from weightmap.compiler.inverse import invert
from weightmap.errors import MappingError, MappingSyntaxError, WeightmapError
from weightmap.language.mapping import load_mapping
from weightmap.language.parse import parse_program
from weightmap.language.unparse import unparse

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))


@SETTINGS
@given(grammar_programs())
def test_generated_programs_compile_or_raise_our_errors(text: str) -> None:
    try:
        mapping = load_mapping(text)
        compile_plan(mapping, HEADERS, CONFIG)
    except WeightmapError:
        return


@SETTINGS
@given(grammar_programs())
def test_unparse_round_trips(text: str) -> None:
    try:
        program = parse_program(text)
    except MappingSyntaxError:
        return
    assert parse_program(unparse(program)) == program


@SETTINGS
@given(grammar_programs())
def test_inverse_is_a_program_or_refused(text: str) -> None:
    try:
        mapping = load_mapping(text)
    except WeightmapError:
        return
    try:
        inverse = invert(mapping)
    except MappingError:
        return
    assert parse_program(inverse.text).stmts == inverse.program.stmts
