"""engine/ and kernels/ never import Qt: checked on the source and in a fresh interpreter."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QT = ("PySide6", "PyQt5", "PyQt6", "shiboken6", "pyqtgraph", "app")


def test_no_qt_import_in_engine_or_kernels_source():
    offenders = []
    for path in [*ROOT.glob("engine/**/*.py"), *ROOT.glob("kernels/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in QT]
    # the CLI starts the GUI when run with no command; that one deferred import is the boundary
    assert offenders == ["engine/cli.py: app.main"]


def test_importing_the_engine_loads_no_qt():
    code = ("import sys, engine.engine, engine.cli, kernels, kernels.reference; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('PySide6', 'shiboken6', 'pyqtgraph')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
