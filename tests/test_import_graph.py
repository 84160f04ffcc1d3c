"""hf_scale's modules import each other in one direction: CLI -> commands -> train -> generators/planner ->
config and the other base modules -> errors, and never in a cycle.

The graph is read from the source with `ast` (nothing is imported): every `import` and `from ... import`, at
module level and inside functions alike (a lazy import is still a dependency), plus the commands the CLI
loads by name (`cli.COMMANDS`).
"""

from __future__ import annotations

import ast

from import_graph import import_graph, layer, modules

# Known exceptions, each owned by work in progress; remove an entry when its edge is gone (a test says so).
ALLOWED: set[tuple[str, str]] = set()  # no exception left


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


def test_the_graph_sees_lazy_imports_and_the_commands_the_cli_loads_by_name():
    graph = import_graph()
    assert "hf_scale.config.distributed_config" in graph["hf_scale.config.presets"]
    assert "hf_scale.train.data.packing" in graph["hf_scale.train.data.batches"]  # imported inside a function
    assert "hf_scale.contract.checkpoint_layout" in graph["hf_scale.commands.export"]  # imported inside a function
    commands = {"hf_scale.commands.demo", "hf_scale.commands.export", "hf_scale.commands.generate"}
    assert commands <= graph["hf_scale.commands.cli"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_there_are_no_import_cycles_among_hf_scalesmodules():
    assert _cycles(_without_allowed(import_graph())) == []


def test_dependencies_point_down_cli_commands_train_generators_config_errors():
    upward = sorted((source, target) for source, targets in _without_allowed(import_graph()).items()
                    for target in targets if layer(target) > layer(source))
    assert upward == []


TRAIN_ROOMS = ("data", "model", "setup", "checkpoint", "loops")
"""hf_scale.train's rooms, lowest first: a room imports only from rooms below it (the data path knows nothing of
models, flags, checkpoints or loops; the model knows its data only through the embedded assets; the loops use
everything). The stage modules (prepare, main, entry) sit above all rooms."""


def train_room(module: str) -> int | None:
    """The rank of `module`'s room in hf_scale.train (the stage modules: above every room); None outside it."""
    parts = module.split(".")
    if parts[:2] != ["hf_scale", "train"] or len(parts) < 3:
        return None
    return TRAIN_ROOMS.index(parts[2]) if parts[2] in TRAIN_ROOMS else len(TRAIN_ROOMS)


def test_every_module_of_hf_scale_train_sits_in_a_room_or_is_a_stage():
    stages = {"hf_scale.train", "hf_scale.train.__main__", "hf_scale.commands.train", "hf_scale.train.main",
              "hf_scale.train.prepare"}
    outside = {m for m in import_graph() if train_room(m) == len(TRAIN_ROOMS)} - stages
    assert outside == set(), "a new module of hf_scale.train goes into a room (CONTRIBUTING.md)"


def test_the_rooms_of_hf_scale_train_import_downwards_only():
    upward = sorted((source, target) for source, targets in import_graph().items() for target in targets
                    if train_room(source) is not None and train_room(target) is not None
                    and train_room(target) > train_room(source))
    assert upward == []


def test_the_room_rule_sees_an_upward_import():
    assert train_room("hf_scale.train.data.packing") < train_room("hf_scale.train.loops.manual")
    assert train_room("hf_scale.train.main") == len(TRAIN_ROOMS)
    assert train_room("hf_scale.config.distributed_config") is None


def test_every_allowed_exception_still_exists():
    graph = import_graph()
    gone = sorted(edge for edge in ALLOWED if edge[1] not in graph.get(edge[0], ()))
    assert gone == [], f"fixed: remove {gone} from ALLOWED"


# Libraries a run needs only for what it asks (LoRA/QLoRA, fp8, Liger, Ray, TensorBoard, plots, cluster validators):
# importing one at module level would make every start of train.py and every `hf-scale` command pay for it.
OPTIONAL_LIBRARIES = ("peft", "bitsandbytes", "torchao", "transformer_engine", "liger_kernel", "ray", "tensorboardX",
                      "torch.utils.tensorboard", "matplotlib", "kubeflow", "jsonschema", "sky", "psutil")


def _module_level_imports(tree: ast.Module) -> list[ast.stmt]:
    """Import statements that run when the module is imported: at top level and in module-level if/try blocks
    (not in functions, classes' methods or `if TYPE_CHECKING:`)."""
    found, pending = [], list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            pending.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            pending.extend(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
        elif isinstance(node, ast.With | ast.ClassDef):
            pending.extend(node.body)
    return found


def _optional_imports(tree: ast.Module) -> list[str]:
    names = []
    for node in _module_level_imports(tree):
        imported = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        names += [name for name in imported if node.__class__ is ast.Import or not node.level
                  if any(name == lib or name.startswith(lib + ".") for lib in OPTIONAL_LIBRARIES)]
    return names


def test_optional_libraries_are_imported_only_inside_the_functions_that_use_them():
    """train.py without LoRA/QLoRA/fp8 and every `hf-scale` command load none of hf_scale's optional libraries
    themselves (transformers may still import what is installed: docs/benchmarks.md, "Start-up")."""
    found = {name: _optional_imports(ast.parse(path.read_text())) for name, path in modules().items()}
    assert {name: libs for name, libs in found.items() if libs} == {}


def test_the_optional_import_rule_sees_a_module_level_import():
    tree = ast.parse("import os\ntry:\n    import peft\nexcept ImportError:\n    pass\n"
                     "def f():\n    import ray\nif TYPE_CHECKING:\n    import torchao\n")
    assert _optional_imports(tree) == ["peft"]


def test_the_runtime_imports_no_generator_and_no_planner_module():
    """train.py's runtime shares with `generate` and `plan` only what sits below all three (hf_scale.contract's
    DeepSpeed JSON and FSDP fields, hf_scale.knowledge's model shapes): a change to a generator or to the planner
    cannot change how a run trains."""
    edges = sorted((source, target) for source, targets in import_graph().items() if source.startswith("hf_scale.train")
                   for target in targets if target.startswith(("hf_scale.generators", "hf_scale.planner")))
    assert edges == []


ENTRY_POINTS = {"hf_scale.commands.train", "hf_scale.commands.ray_train", "hf_scale.train.__main__"}


def test_only_the_entry_points_import_the_runtimes_internals():
    """train.py's flags, its checkpoint layout and verification, the values it shares with the launchers' files and
    its refusals' words are hf_scale.contract's (or hf_scale.knowledge's); the commands and their libraries read those,
    not hf_scale.train."""
    edges = {(source, target) for source, targets in import_graph().items()
             if not source.startswith("hf_scale.train") and source not in ENTRY_POINTS
             for target in targets if target.startswith("hf_scale.train.")}
    assert edges == set()
