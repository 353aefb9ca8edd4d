"""No import circles in ``hyperpar/`` or the backends: modules import each other in one
direction. The graph comes from the source's syntax (``ast``), not from importing it (so the
MindSpore backend is checked without MindSpore): every ``import`` and ``from ... import`` at any
depth: inside functions too, where a lazy import hides a circle, and under ``if TYPE_CHECKING:``
(a type-only import still ties one module's design to the other's; a ``Protocol`` breaks it);
``importlib.import_module("name")`` with a literal name (how the MindSpore platform handed out
its styles' mechanics, closing an 11-module circle the other forms did not show);
``from package import name`` is an edge to the submodule ``package.name`` when there is one,
else to the package's ``__init__``. A circle is a strongly connected component of more than one
module. There are no known exceptions.

The MindSpore backend is also held to its layers (:data:`MINDSPORE_LAYERS`, bottom first): a
module imports only modules of its own layer or below, and every module has a layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"hyperpar": ROOT / "hyperpar",
            **{d.name.replace("-", "_"): d / d.name.replace("-", "_")
               for d in sorted((ROOT / "backends").iterdir()) if d.is_dir()}}

_MS = "hyperpar_mindspore."
#: The MindSpore backend's layers, bottom first (docs/architecture.md, "Import direction"):
#: the platform's parts; tensor mechanics; the DTensor op layer; the styles' mechanics; the
#: features built on them; and on top what the registry and the launcher load -- the assembled
#: ``MindSporePlatform``, which hands out the styles' mechanics, the parallel API, the MoE
#: all-to-all and the launcher from the layers below it when asked (as torch_base does).
MINDSPORE_LAYERS: tuple[tuple[str, ...], ...] = (
    ("runtime", "tensors", "collectives", "launch_env"),
    ("redistribute", "dtensor_core", "param_readback", "localops"),
    ("opnames", "dispatch", "listops", "lossops", "gradwrap", "dtensor"),
    ("comm", "graph", "parallel", "prepare", "loss", "layers", "moe", "moe_styles"),
    ("fsdp_graph", "fsdp_sections", "fully_shard", "data_parallel", "pipeline", "pipeline_p2p",
     "pipeline_schedules", "pipeline_engine", "optim_cross", "checkpoint"),
    ("platform", "plugin", "launch", "worker", "scheduler", ""),
)


def _modules() -> dict[str, Path]:
    out = {}
    for folder in PACKAGES.values():
        if not folder.is_dir():
            continue
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _is_import_module(func: ast.expr) -> bool:
    """``importlib.import_module`` or a bare ``import_module`` (``from importlib import ...``)."""
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module" and isinstance(func.value, ast.Name) \
            and func.value.id == "importlib"
    return isinstance(func, ast.Name) and func.id == "import_module"


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """``(imported module, names)`` of every runtime import in ``tree``."""
    found: list[tuple[str, list[str]]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif (isinstance(node, ast.Call) and _is_import_module(node.func) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            # importlib.import_module("literal"[, package]): an import all the same
            name = node.args[0].value
            if name.startswith("."):
                level = len(name) - len(name.lstrip("."))
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (level - 1)]
                name = ".".join(package + ([name[level:]] if name[level:] else []))
            found.append((name, []))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            found.append((base, [alias.name for alias in node.names]))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return _graph_of({m: (p.read_text(), p.name == "__init__.py") for m, p in modules.items()})


def _graph_of(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules it imports, from ``{module: (source, is a package)}``."""
    graph: dict[str, set[str]] = {m: set() for m in sources}
    for module, (source, is_package) in sources.items():
        for target, names in _imports(ast.parse(source, module), module, is_package):
            hits = [f"{target}.{n}" for n in names if f"{target}.{n}" in sources]
            if len(hits) < len(names) or not names:
                # a name that is not a submodule comes from the package (or module) itself;
                # ``import a.b.c`` runs every package on the way
                parts = target.split(".")
                hits += [".".join(parts[:i]) for i in range(len(parts), 0, -1)
                         if ".".join(parts[:i]) in sources][:1]
            graph[module].update(h for h in hits if h != module)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(frozenset(component))
    return out


def _describe(circle: frozenset[str], graph: dict[str, set[str]]) -> str:
    edges = sorted(f"{a} -> {b}" for a in circle for b in graph[a] if b in circle)
    return f"{len(circle)} modules: " + "; ".join(edges)


def test_the_graph_sees_lazy_and_type_only_import_circles() -> None:
    """The analysis itself: circles closed only by an import inside a function, or only by
    one under ``if TYPE_CHECKING:``, are found; a one-way import is not a circle."""
    sources = {"p.a": "from . import b\nfrom .c import z\n",
               "p.b": "def f():\n    from .a import x\n",
               "p.c": "import typing\nif typing.TYPE_CHECKING:\n    from .d import y\n",
               "p.d": "from .c import w\n", "p.e": "from .a import v\n"}
    graph = _graph_of({m: (src, False) for m, src in sources.items()})
    assert sorted(map(sorted, _circles(graph))) == [["p.a", "p.b"], ["p.c", "p.d"]]


def test_the_graph_sees_import_module_with_a_literal_name() -> None:
    """``importlib.import_module("p.b")`` (or a relative name with its package) is an edge; a
    name built at run time cannot be read and is not."""
    sources = {"p.a": "import importlib\ndef f():\n    return importlib.import_module('p.b')\n",
               "p.b": "from .a import x\n",
               "p.c": "from importlib import import_module\nimport_module('.d', __name__)\n",
               "p.d": "from . import c\n",
               "p.e": "import importlib\nimportlib.import_module(f'p.{1}')\n",
               "p.f": "from .e import y\n"}
    graph = _graph_of({m: (src, False) for m, src in sources.items()})
    assert sorted(map(sorted, _circles(graph))) == [["p.a", "p.b"], ["p.c", "p.d"]]


def test_no_import_circles() -> None:
    graph = _graph()
    assert "hyperpar.checkpoint._format" in graph and graph["hyperpar.checkpoint.writer"]
    assert any(m.startswith(_MS) for m in graph)  # the MindSpore backend is in the graph
    circles = _circles(graph)
    assert not circles, "import circles:\n" + "\n".join(_describe(c, graph) for c in circles)


def _layer_violations(graph: dict[str, set[str]],
                      layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Imports of ``graph`` (names under hyperpar_mindspore) that point up ``layers``, and
    modules with no layer."""
    level = {_MS + m if m else _MS[:-1]: i for i, layer in enumerate(layers) for m in layer}
    out = [f"{m}: no layer in MINDSPORE_LAYERS" for m in sorted(graph)
           if (m == _MS[:-1] or m.startswith(_MS)) and m not in level]
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if module in level and target in level and level[target] > level[module]:
                out.append(f"{module} (layer {level[module]}) imports {target} "
                           f"(layer {level[target]})")
    return out


def test_the_layer_check_finds_an_upward_import() -> None:
    graph = {_MS + "runtime": {_MS + "dtensor"}, _MS + "dtensor": {_MS + "runtime"},
             _MS + "new": set()}
    assert _layer_violations(graph, (("runtime",), ("dtensor",))) == [
        f"{_MS}new: no layer in MINDSPORE_LAYERS",
        f"{_MS}runtime (layer 0) imports {_MS}dtensor (layer 1)"]


def test_the_mindspore_backend_imports_only_down_its_layers() -> None:
    graph = _graph()
    assert _MS + "platform" in graph and _MS + "dtensor_core" in graph
    bad = _layer_violations(graph, MINDSPORE_LAYERS)
    assert not bad, "MindSpore layering:\n" + "\n".join(bad)
