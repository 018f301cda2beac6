"""engine/ and kernels/ never import Qt: checked on the source and in a fresh interpreter."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QT = ("PySide6", "PyQt5", "PyQt6", "shiboken6", "pyqtgraph", "app")


def _local(name: str) -> str:
    """`stowage.engine.x` -> `engine.x`: the folders install under `stowage.`, the walk names modules by folder."""
    return name.removeprefix("stowage.")


def test_no_qt_import_in_engine_or_kernels_source():
    offenders = []
    for path in [*ROOT.glob("engine/**/*.py"), *ROOT.glob("kernels/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if _local(n).split(".")[0] in QT]
    # the top-level stowage_entry.py dispatches to the GUI or the engine's CLI: no exception here
    assert offenders == []


def test_importing_the_engine_loads_no_qt():
    code = ("import sys, stowage.engine.runtime.engine, stowage.engine.cli, stowage.kernels, stowage.kernels.reference; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('PySide6', 'shiboken6', 'pyqtgraph')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-P", "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _engine_imports() -> dict[str, set[str]]:
    """engine module -> the engine modules it imports (anywhere in the file: a deferred import is still a dependency)."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.glob("engine/**/*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name.split(".") if parts[-1] == "__init__" else name.split(".")[:-1]
        deps = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [_local(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join(base + ([_local(node.module)] if node.module else []))
                # `from . import x` names a module x; `from .m import f` names m
                targets = [f"{module}.{a.name}" for a in node.names] + [module]
            else:
                continue
            deps |= {t for t in targets if t.split(".")[0] == "engine" and t != name}
    known = set(graph)
    return {m: {d for d in deps if d in known} for m, deps in graph.items()}


def test_no_import_cycles_in_the_engine():
    graph = _engine_imports()
    assert "engine.planning.plan" in graph["engine.planning.report"]  # the walk sees relative imports
    cycles, state = [], {}

    def visit(module: str, stack: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph[module]):
            if dep.startswith(module + ".") or module.startswith(dep + "."):
                continue  # a package and its own modules (`__init__` re-exports) are one unit
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []
