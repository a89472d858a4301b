"""The library's shape: layers import only downward, no module imports itself back, no function is too long.

Layers, lowest first (docs/design.md explains each):

    wire -> kernels -> algorithms -> engine and transports -> stock Horovod -> hvd_compress (the package
    facade) -> routes -> tools

Every ``import`` of an ``hvd_compress`` module counts, at module level or inside a
function (a lazy import is still an arrow). A module may import its own layer
or a lower one; the graph as a whole must have no circle.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = Path(__file__).resolve().parents[1] / "hvd_compress"

LAYERS = [
    ("wire", ["hvd_compress.wire"]),
    ("kernels", ["hvd_compress.kernels"]),
    ("algorithms", ["hvd_compress.algorithms"]),
    ("engine and transports", ["hvd_compress.engine", "hvd_compress.transport", "hvd_compress.simulator"]),
    ("stock Horovod", ["hvd_compress.horovod"]),
    ("package", ["hvd_compress"]),
    ("routes", ["hvd_compress.torch", "hvd_compress.tensorflow", "hvd_compress.keras", "hvd_compress.mpi"]),
    ("tools", ["hvd_compress.bench", "hvd_compress.cli"]),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> Dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    """Index of the layer whose longest prefix matches ``module``."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS and docs/design.md"
    return best


def imports_of(module: str, path: Path, known: Set[str]) -> Set[str]:
    """The ``hvd_compress`` modules ``module`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    found: Set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "hvd_compress")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "hvd_compress":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    found.discard(module)
    return found


def graph() -> Dict[str, Set[str]]:
    known = modules()
    return {module: imports_of(module, path, set(known)) for module, path in known.items()}


def test_every_import_points_to_the_same_or_a_lower_layer():
    upward: List[str] = []
    for module, targets in graph().items():
        for target in sorted(targets):
            if layer_of(target) > layer_of(module):
                upward.append(
                    f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
                )
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def test_the_library_never_imports_the_studies():
    """``benchmarks/`` is not installed: nothing in ``hvd_compress`` may import it."""
    offenders = []
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{module} imports {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert not offenders, "\n".join(offenders)


def test_the_import_graph_has_no_circle():
    edges = graph()
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []
    circles: List[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                circles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_walker_sees_lazy_and_relative_imports(tmp_path):
    """The checks above can fail: a lazy import inside a function is found."""
    source = "def f():\n    from hvd_compress.engine import fused\n    from . import sparse\n"
    probe = tmp_path / "base.py"
    probe.write_text(source)
    found = imports_of("hvd_compress.algorithms.base", probe, {"hvd_compress.engine.fused",
                                                               "hvd_compress.algorithms.sparse"})
    assert found == {"hvd_compress.engine.fused", "hvd_compress.algorithms.sparse"}


#: what the exchanges and routes call a compressor in their code
COMPRESSOR_NAMES = {"compressor", "compression", "inner", "tern"}


def private_compressor_reads(source: str, where: str) -> List[str]:
    """``compressor._x`` / ``self.compressor._x`` / ``compressor.__dict__`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
        if name in COMPRESSOR_NAMES and (not node.attr.startswith("__") or node.attr == "__dict__"):
            found.append(f"{where}:{node.lineno}: {name}.{node.attr}")
    return sorted(found)


def test_the_exchanges_read_no_private_compressor_attribute():
    """The engine, transports, routes and the simulator use the compressor's public API and ``compressor.state``."""
    found = []
    for module, path in modules().items():
        if layer_of(module) >= layer_of("hvd_compress.engine"):
            found += private_compressor_reads(path.read_text(), module)
    assert not found, "\n".join(found)
    assert private_compressor_reads("compressor._buckets.pop(k)\nx = self.compressor.__dict__", "probe") == [
        "probe:1: compressor._buckets", "probe:2: compressor.__dict__"]


#: the longest a library function may be, its docstring included: longer ones are split into named steps
MAX_FUNCTION_LINES = 60


def test_no_library_function_is_longer_than_the_limit():
    long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def run_time_reaches(source: str, where: str) -> List[str]:
    """Thread-local state and lookups of loaded modules in ``sys.modules`` (other than a third-party
    module's literal name) in ``source``: couplings that no import shows. (The kernels' lazy
    ``import_module`` of a framework's own kernel modules, from a fixed list, is an import.)"""
    def ours(key: ast.AST) -> bool:
        return not (isinstance(key, ast.Constant) and not str(key.value).startswith("hvd_compress"))

    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Attribute) and node.attr == "local" and getattr(node.value, "id", "") == "threading":
            found.append(f"{where}:{node.lineno}: threading.local")
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "sys.modules.get":
            if node.args and ours(node.args[0]):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules" and ours(node.slice):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return sorted(found)


def test_no_thread_local_state_and_no_module_looked_up_by_name():
    """Run state is handed down explicitly and layers meet through imports only."""
    found = [hit for module, path in modules().items() for hit in run_time_reaches(path.read_text(), module)]
    assert not found, "\n".join(found)
    probe = ("import sys, threading\n_S = threading.local()\nm = sys.modules.get(NAME)\n"
             "n = sys.modules['hvd_compress.y']\nk = sys.modules.get('keras')\n")
    assert [hit.split(": ")[1] for hit in run_time_reaches(probe, "probe")] == [
        "threading.local", "sys.modules.get(NAME)", "sys.modules['hvd_compress.y']"]
