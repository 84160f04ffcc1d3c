"""hf_scale's modules import each other in one direction: CLI -> commands -> train -> generators/planner ->
config and the other base modules -> errors, and never in a cycle.

The graph is read from the source with `ast` (nothing is imported): every `import` and `from ... import`, at
module level and inside functions alike (a lazy import is still a dependency), plus the commands the CLI
loads by name (`cli.COMMANDS`).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import hf_scale
from hf_scale.cli import COMMANDS

PACKAGE = Path(hf_scale.__file__).parent

# Known exceptions, each owned by work in progress; remove an entry when its edge is gone (a test says so).
ALLOWED: set[tuple[str, str]] = set()  # no exception left


def _modules() -> dict[str, Path]:
    modules = {}
    for file in PACKAGE.rglob("*.py"):
        parts = file.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    return modules


def _imported(node: ast.AST, package: str, modules: dict[str, Path]) -> set[str]:
    """The hf_scale modules an import statement reaches: `from a import b` reaches the submodule a.b when
    there is one, else the module a itself."""
    if isinstance(node, ast.Import):
        return {_owner(alias.name, modules) for alias in node.names}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:
        parent = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*parent, base] if base else parent)
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else _owner(base, modules) for a in node.names}


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The hf_scale module defining `name` (None outside hf_scale)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
def import_graph() -> dict[str, frozenset[str]]:
    """{module: the hf_scale modules it imports}."""
    modules = _modules()
    graph = {}
    for name, file in modules.items():
        package = name if file.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            targets |= _imported(node, package, modules)
        graph[name] = frozenset(targets - {None, name})
    graph["hf_scale.cli"] |= {module for module, _ in COMMANDS.values()}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _without_allowed(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {source: {t for t in targets if (source, t) not in ALLOWED} for source, targets in graph.items()}


def layer(module: str) -> int:
    """errors and exit_codes 0, base modules (config, presets, inputs, ...) 1, generators/planner 2, train 3,
    commands 4, cli 5."""
    # `python -m hf_scale.ray_train` is an entry point like the commands: it runs train.py's train function.
    commands = {name for name, _ in COMMANDS.values()} | {"hf_scale.ray_train"}
    if module == "hf_scale.cli":
        return 5
    if any(module == c or module.startswith(c + ".") for c in commands):
        return 4
    if module.startswith("hf_scale.train"):
        return 3
    if module.startswith(("hf_scale.generators", "hf_scale.planner")):
        return 2
    return 0 if module in ("hf_scale.errors", "hf_scale.exit_codes") else 1


def test_the_graph_sees_lazy_imports_and_the_commands_the_cli_loads_by_name():
    graph = import_graph()
    assert "hf_scale.config" in graph["hf_scale.presets"]
    assert "hf_scale.train.data.packing" in graph["hf_scale.train.data.batches"]  # imported inside a function
    assert "hf_scale.train.checkpoint.layout" in graph["hf_scale.export"]  # `from hf_scale.train import x` inside one
    assert {"hf_scale.demo", "hf_scale.export", "hf_scale.generate"} <= graph["hf_scale.cli"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_there_are_no_import_cycles_among_hf_scales_modules():
    assert _cycles(_without_allowed(import_graph())) == []


def test_dependencies_point_down_cli_commands_train_generators_config_errors():
    upward = sorted((source, target) for source, targets in _without_allowed(import_graph()).items()
                    for target in targets if layer(target) > layer(source))
    assert upward == []


def test_every_allowed_exception_still_exists():
    graph = import_graph()
    gone = sorted(edge for edge in ALLOWED if edge[1] not in graph.get(edge[0], ()))
    assert gone == [], f"fixed: remove {gone} from ALLOWED"
