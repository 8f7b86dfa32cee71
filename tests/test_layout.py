"""The package's shape: stages import only downwards, and the public surface is pinned.

fs -> format -> inputs -> language -> plan -> compiler -> execute -> modes -> api/cli: a module
may import from its own stage and the stages below it, never above (no circle, not even a lazy
import inside a function or one made for type checking alone), so the pipeline can be read from
the file list alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

import weightmap

SRC = Path(weightmap.__file__).parent
# Bottom to top; errors.py sits below everything (it imports nothing of ours). fs: the file
# system and process helpers; format: the safetensors bytes; inputs: checkpoints, pickles, the
# Hub and side files; modes: the ways remap runs a plan; loads: will the output load.
LAYERS = [
    "errors",
    "fs",
    "format",
    "inputs",
    "language",
    "plan",
    "compiler",
    "binding",
    "execute",
    "modes",
    "loads",
    "api",
    "cli",
]


def _stage(module: str) -> str:
    """``weightmap.format.header`` -> ``format``; top-level modules are their own stage."""
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else "__init__"
    return name


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every ``weightmap.*`` module imported, at run time or for type checking alone (an
    arrow that runs up only for the type checker still ties the lower stage to the upper)."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("weightmap"):
            if node.module == "weightmap":
                found += [(node.lineno, f"weightmap.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("weightmap")]
    return found


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def test_stages_import_only_downwards() -> None:
    problems = []
    for path in sorted(SRC.rglob("*.py")):
        me = _stage(_module_name(path))
        if me in ("__init__", "__main__"):
            continue  # the package root re-exports the public API from every stage
        assert me in LAYERS, f"{path}: unknown stage {me!r}; add it to LAYERS"
        for line, target in _imports(path):
            other = _stage(target)
            if other == "__init__":
                problems.append(f"{path}:{line}: imports the package root ({target})")
            elif LAYERS.index(other) > LAYERS.index(me):
                problems.append(f"{path}:{line}: stage {me} imports {target} (stage {other})")
    assert not problems, "\n".join(problems)


def test_no_import_cycles_between_modules() -> None:
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        graph[_module_name(path)] = {t for _line, t in _imports(path)}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join([*trail, node, nxt])
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_public_surface_is_pinned() -> None:
    # Adding or removing a public name is a decision: update this list and the docs together.
    assert set(weightmap.__all__) == {
        "Cancelled",
        "Checkpoint",
        "CheckpointError",
        "ExecutionError",
        "FormatError",
        "LoadError",
        "LoadReport",
        "Mapping",
        "MappingError",
        "MappingSyntaxError",
        "OutputExistsError",
        "Plan",
        "PlanError",
        "Result",
        "WeightmapError",
        "__version__",
        "check_loads",
        "compile",
        "invert",
        "iter_tensors",
        "load_mapping",
        "presets",
        "recover",
        "remap",
        "verify",
    }
    for name in weightmap.__all__:
        assert hasattr(weightmap, name), name


def test_no_torch_at_import_time() -> None:
    import subprocess
    import sys

    code = "import sys, weightmap, weightmap.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
