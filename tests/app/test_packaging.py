"""The packaging files agree with the package: entry point, scripts, icons and bundled assets exist.

Building the PyInstaller bundle is too slow for CI, so the spec's constants are read with `ast` and
checked here instead; the desktop installer runs for real into a temporary data dir.
"""

import ast
import configparser
import importlib
import os
import struct
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGING = ROOT / "packaging"
ICON_SIZES = (16, 24, 32, 48, 64, 128, 256)


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def spec_constants() -> dict:
    tree = ast.parse((PACKAGING / "stowage.spec").read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                found[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass  # computed values (Analysis(...), paths) are PyInstaller's business
    return found


def spec_call_keywords(func: str) -> dict:
    tree = ast.parse((PACKAGING / "stowage.spec").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == func:
            return {k.arg: k.value for k in node.keywords}
    raise AssertionError(f"stowage.spec has no {func}(...) call")


def desktop_entry() -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str  # keys are case-sensitive in desktop files
    parser.read(PACKAGING / "stowage.desktop")
    return parser["Desktop Entry"]


def resolve(target: str):
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_gui_script_entry_point_is_callable():
    target = pyproject()["project"]["gui-scripts"]["stowage-gui"]
    assert callable(resolve(target))


def test_spec_entry_matches_the_gui_script_and_the_launcher():
    entry = spec_constants()["ENTRY"]
    assert entry == pyproject()["project"]["gui-scripts"]["stowage-gui"]
    assert callable(resolve(entry))
    module, function = entry.split(":")
    launcher = ast.parse((PACKAGING / "launch.py").read_text())
    imports = [(n.module, a.name) for n in ast.walk(launcher) if isinstance(n, ast.ImportFrom) for a in n.names]
    assert (module, function) in imports


def test_spec_is_windowed_and_bundles_existing_assets():
    consts = spec_constants()
    console = spec_call_keywords("EXE")["console"]
    assert isinstance(console, ast.Constant) and console.value is False
    destinations = {dst for _, dst in consts["DATAS"]}
    assert {"assets/demo-model", "assets/icons"} <= destinations
    for src, _ in consts["DATAS"]:
        assert (ROOT / src).is_dir(), f"stowage.spec bundles {src}, which does not exist"
    model = ROOT / "assets" / "demo-model"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (model / name).is_file(), f"the demo model lacks {name}"
    # Runtime dependencies must not be excluded from the bundle.
    runtime = {d.split(">")[0].split("<")[0].split("=")[0].strip().lower() for d in pyproject()["project"]["dependencies"]}
    assert not runtime & {e.lower() for e in consts["EXCLUDES"]}


def test_desktop_entry_runs_a_declared_gui_script():
    entry = desktop_entry()
    assert entry["Type"] == "Application"
    assert entry["Terminal"] == "false"
    command = entry["Exec"].split()[0]
    assert command in pyproject()["project"]["gui-scripts"]
    assert entry["TryExec"] == command
    assert entry["Icon"] == "stowage"
    assert entry["Categories"].endswith(";")


def test_icons_exist_in_every_size():
    icons = ROOT / "assets" / "icons"
    assert (icons / "stowage.svg").read_text().lstrip().startswith("<?xml")
    for size in ICON_SIZES:
        assert png_size(icons / f"stowage-{size}.png") == (size, size)


def test_install_desktop_writes_launcher_and_icons_then_uninstalls(tmp_path):
    gui = tmp_path / "dir with space" / "stowage-gui"
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "share"), "STOWAGE_GUI": str(gui)}
    script = str(PACKAGING / "install_desktop.sh")
    subprocess.run([script], env=env, check=True, capture_output=True)

    launcher = tmp_path / "share" / "applications" / "stowage.desktop"
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str
    parser.read(launcher)
    assert parser["Desktop Entry"]["Exec"] == f'"{gui}"'
    assert parser["Desktop Entry"]["TryExec"] == str(gui)
    hicolor = tmp_path / "share" / "icons" / "hicolor"
    assert (hicolor / "scalable" / "apps" / "stowage.svg").is_file()
    for size in ICON_SIZES:
        assert png_size(hicolor / f"{size}x{size}" / "apps" / "stowage.png") == (size, size)

    subprocess.run([script, "--uninstall"], env=env, check=True, capture_output=True)
    assert not launcher.exists()
    assert not (hicolor / "256x256" / "apps" / "stowage.png").exists()
