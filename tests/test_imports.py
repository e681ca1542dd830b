"""The package's layers: no import cycles, and each layer imports only the ones beneath it.

Every import statement counts, at module level or inside a function (a function-level
import hides a cycle from Python, not from a reader). Imports under `if TYPE_CHECKING:`
are for annotations only and never run, so they do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ranvier

PACKAGE = Path(ranvier.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside `if TYPE_CHECKING:` blocks."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skipped |= {id(inner) for inner in ast.walk(node) if isinstance(inner, (ast.Import, ast.ImportFrom))}
    return skipped


def _resolve(name: str) -> str | None:
    """The ranvier module an imported name lives in (ranvier.ops.registry.define -> ranvier.ops.registry)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The ranvier modules one import statement loads."""
    if isinstance(node, ast.Import):
        targets = [_resolve(alias.name) for alias in node.names]
    else:
        package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
        base = ".".join(filter(None, [base, node.module]))
        targets = [_resolve(f"{base}.{alias.name}") for alias in node.names]
    return {target for target in targets if target is not None and target != module}


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        skipped = _type_checking_only(tree)
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped:
                edges |= _imported(module, node)
        graph[module] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _layer(module: str) -> str:
    """ranvier.flow.builder -> ranvier.flow; ranvier.runtime -> ranvier.runtime."""
    return ".".join(module.split(".")[:2])


def _layer_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    layers: dict[str, set[str]] = {}
    for module, targets in graph.items():
        layers.setdefault(_layer(module), set()).update(_layer(t) for t in targets if _layer(t) != _layer(module))
    return layers


def test_the_walker_sees_function_level_imports():
    graph = import_graph()
    assert "ranvier.ops.registry" in graph["ranvier.ops.elementwise"]
    assert "ranvier.backends.cpu.backend" not in graph["ranvier.backends"]  # named in a string, imported lazily
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_itself_back():
    cycles = _cycles(import_graph())
    assert not cycles, f"import cycles: {cycles}"


def test_no_layer_imports_itself_back():
    cycles = _cycles(_layer_graph(import_graph()))
    assert not cycles, f"import cycles between layers: {cycles}"


# The layers from the bottom up, as the README lists them: each may import only the
# layers before it. The package's own __init__ (the Myelin-style API) sits on top.
ORDER = [
    "ranvier.errors", "ranvier.version", "ranvier.dtypes", "ranvier.atomic", "ranvier.guards", "ranvier.limits", "ranvier.safetensors_file", "ranvier.debug", "ranvier.progress",
    "ranvier.distributed",
    "ranvier.dashboard", "ranvier.plot", "ranvier.data",
    "ranvier.ops", "ranvier.flow", "ranvier.nn", "ranvier.autodiff", "ranvier.profile", "ranvier.handles", "ranvier.runtime",
    "ranvier.backends",
    "ranvier.compiler", "ranvier.models", "ranvier.generate", "ranvier.onnx", "ranvier.train", "ranvier.interop",
    "ranvier.jobs", "ranvier.modelrun",
    "ranvier", "ranvier.cli",
]


def test_the_layer_order_names_every_layer():
    assert set(ORDER) == set(_layer_graph(import_graph())) | {"ranvier"}


def test_each_layer_imports_only_the_layers_beneath_it():
    layers = _layer_graph(import_graph())
    wrong = {
        layer: sorted(t for t in layers.get(layer, set()) if ORDER.index(t) > position)
        for position, layer in enumerate(ORDER)
        if any(ORDER.index(t) > position for t in layers.get(layer, set()))
    }
    assert not wrong, f"layers importing layers above them: {wrong}"


# Backends that sit side by side: neither may import the other's modules (what they share
# lives in ranvier.backends itself: the protocol, the compile cache, the LLVM helpers, and the
# numpy reference a backend runs an op it has no kernel for with).
SIBLING_BACKENDS = ["ranvier.backends.cpu", "ranvier.backends.cuda"]
# The one crossing, with its reason: the CUDA backend's host emulator runs the GPU's kernels
# on this CPU, compiled and loaded by the CPU backend's LLVM loader.
CROSSINGS = {"ranvier.backends.cuda.emulator": {"ranvier.backends.cpu.jit", "ranvier.backends.cpu.target"}}


def _sibling(module: str) -> str | None:
    return next((s for s in SIBLING_BACKENDS if module == s or module.startswith(f"{s}.")), None)


def _crossings(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Imports from one sibling backend into another, less the allowed ones."""
    found = {}
    for module, targets in graph.items():
        home = _sibling(module)
        wrong = sorted(t for t in targets - CROSSINGS.get(module, set()) if home and _sibling(t) not in (None, home))
        if wrong:
            found[module] = wrong
    return found


def test_sibling_backends_do_not_import_each_other():
    crossings = _crossings(import_graph())
    assert not crossings, f"backends importing another backend's modules: {crossings}"


def test_the_sibling_check_sees_a_crossing():
    graph = {"ranvier.backends.cuda.backend": {"ranvier.backends.cpu.jit", "ranvier.backends.compile_cache"},
             "ranvier.backends.cpu.backend": {"ranvier.backends.cuda.ptx", "ranvier.backends.cpu.jit"},
             "ranvier.backends.cuda.emulator": {"ranvier.backends.cpu.jit"}}
    assert _crossings(graph) == {"ranvier.backends.cuda.backend": ["ranvier.backends.cpu.jit"],
                                 "ranvier.backends.cpu.backend": ["ranvier.backends.cuda.ptx"]}


# The application: what the `ranvier` command runs (its jobs, their run directories, the
# model tools), above every library layer. A library layer imports none of it.
APPLICATION = ["ranvier.jobs", "ranvier.modelrun", "ranvier.cli"]


def _library_importing_application(layers: dict[str, set[str]]) -> dict[str, list[str]]:
    return {layer: sorted(targets & set(APPLICATION)) for layer, targets in layers.items()
            if layer not in APPLICATION and layer != "ranvier" and targets & set(APPLICATION)}


def test_no_library_layer_imports_the_application():
    wrong = _library_importing_application(_layer_graph(import_graph()))
    assert not wrong, f"library layers importing application modules: {wrong}"


def test_the_application_sits_on_top():
    assert ORDER[-len(APPLICATION) - 1 :] == [*APPLICATION[:-1], "ranvier", "ranvier.cli"]
    assert _library_importing_application({"ranvier.interop": {"ranvier.jobs", "ranvier.models"}}) == {
        "ranvier.interop": ["ranvier.jobs"]}
