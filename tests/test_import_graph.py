"""The package's layering, read from its source with ``ast``: the model side (attention, models,
layers, kvcache, kernels, quant and the step types in ``tpserve.forward``) never imports the engine,
the scheduler or the processes above them, and no modules import each other in a circle.
Imports under ``if TYPE_CHECKING:`` are annotations only: they count for layering, not circles."""

from __future__ import annotations

import ast
from pathlib import Path

import tpserve

ROOT = Path(tpserve.__file__).parent
LOW = ("attention", "models", "layers", "kvcache", "kernels", "forward", "quant")
HIGH = ("engine", "scheduler", "server", "launch", "llm")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported tpserve module, only for type checking) for every import in the file."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name, typing_only) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                for alias in child.names:
                    sub = f"{child.module}.{alias.name}"
                    found.append((sub if sub in MODULES else child.module, typing_only))
            visit(child, typing_only or (isinstance(child, ast.If) and is_type_checking(child)))

    visit(ast.parse(path.read_text()), False)
    return [(name, typing_only) for name, typing_only in found if name in MODULES]


GRAPH = {name: imports(path) for name, path in MODULES.items()}


def area(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_the_model_side_never_imports_the_engine_or_above():
    upward = [
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        if area(module) in LOW
        for target, _ in targets
        if area(target) in HIGH
    ]
    assert not upward, "imports from the model side up to the engine or above:\n" + "\n".join(upward)


def test_no_import_cycles():
    runtime = {m: sorted({t for t, typing_only in targets if not typing_only and t != m}) for m, targets in GRAPH.items()}
    state: dict[str, str] = {}  # "open" while on the DFS stack, then "done"
    cycles: list[str] = []

    def walk(module: str, stack: list[str]) -> None:
        state[module] = "open"
        for target in runtime[module]:
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target) :] + [module, target]))
            elif target not in state:
                walk(target, stack + [module])
        state[module] = "done"

    for module in sorted(runtime):
        if module not in state:
            walk(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_graph_is_read():
    assert ("tpserve.forward", False) in GRAPH["tpserve.attention.base"]
    assert ("tpserve.attention.base", True) in GRAPH["tpserve.forward"]
