"""Stage 3, the mapping language: grammar, parser, syntax tree, expressions, loading programs.

Turns text into an immutable :class:`~weightmap.language.ast.Program`; knows nothing of plans.
"""
