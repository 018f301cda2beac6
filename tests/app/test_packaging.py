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
import shutil
import tomllib
from pathlib import Path

import pytest

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


def test_spec_entry_matches_the_stowage_script_and_the_launcher():
    # the bundle's executable is `stowage`: the app with no arguments, the engine's commands with some (how the
    # app starts its engine process there)
    entry = spec_constants()["ENTRY"]
    assert entry == pyproject()["project"]["scripts"]["stowage"]
    assert callable(resolve(entry))
    module, function = entry.split(":")
    launcher = ast.parse((PACKAGING / "launch.py").read_text())
    imports = [(n.module, a.name) for n in ast.walk(launcher) if isinstance(n, ast.ImportFrom) for a in n.names]
    assert (module, function) in imports
    for name in spec_constants()["HIDDEN_IMPORTS"]:
        importlib.import_module(name)


def test_a_bundle_starts_its_engine_with_its_own_executable(monkeypatch):
    from stowage.engine.planning.plan import PlanRequest
    from stowage.engine.process import engine_process

    assert engine_process.engine_command()[1:] == ["-P", "-m", "stowage.engine.cli"]
    monkeypatch.setattr(engine_process.sys, "frozen", True, raising=False)
    command = engine_process.serve_command("/models/m", PlanRequest(1024))
    assert command[:3] == [engine_process.sys.executable, "serve", "/models/m"]


def test_spec_is_windowed_and_bundles_existing_assets():
    consts = spec_constants()
    console = spec_call_keywords("EXE")["console"]
    assert isinstance(console, ast.Constant) and console.value is False
    destinations = {dst for _, dst in consts["DATAS"]}
    assert {"stowage/assets/demo-model", "stowage/assets/icons"} <= destinations
    for src, _ in consts["DATAS"]:
        assert (ROOT / src).exists(), f"stowage.spec bundles {src}, which does not exist"
    # Every package-data file pyproject.toml ships with a package is in the bundle too, where the package has it.
    folders = pyproject()["tool"]["setuptools"]["package-dir"]
    shipped = 0
    for package, patterns in pyproject()["tool"]["setuptools"]["package-data"].items():
        for pattern in patterns:
            for path in (ROOT / folders[package]).glob(pattern):
                relative = path.relative_to(ROOT)
                where = [dst for src, dst in consts["DATAS"] if relative.is_relative_to(src)]
                assert where, f"the bundle lacks {relative}"
                assert where[0].startswith(package.replace(".", "/")), f"{relative} lies outside {package}"
                shipped += 1
    assert shipped > 10  # the demo model, the icons, the C sources at least
    assert {"packaging/stowage.desktop", "packaging/install_desktop.sh"} <= {src for src, _ in consts["DATAS"]}
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
    gui = fake_gui(tmp_path / "dir with space")
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


def test_the_application_is_named_before_its_first_window(monkeypatch, qapp):
    # X11's WM_CLASS is fixed when the first window (the splash) is created, from the application name
    # at that moment; the launcher's StartupWMClass must match it, or docks cannot tie the window to it.
    from PySide6 import QtWidgets
    from PySide6.QtGui import QGuiApplication

    from stowage.app import main as app_main

    seen = {}

    class Splash(QtWidgets.QSplashScreen):
        def show(self):
            seen["name"] = QGuiApplication.applicationName()
            seen["desktop"] = QGuiApplication.desktopFileName()
            raise KeyboardInterrupt  # stop main() here: the window itself is not needed

    before = (qapp.applicationName(), qapp.organizationName(), QGuiApplication.desktopFileName())
    monkeypatch.setattr(QtWidgets, "QSplashScreen", Splash)
    try:
        try:
            app_main.main([])
        except KeyboardInterrupt:
            pass
    finally:
        qapp.setApplicationName(before[0])
        qapp.setOrganizationName(before[1])
        QGuiApplication.setDesktopFileName(before[2])
    assert seen == {"name": desktop_entry()["StartupWMClass"], "desktop": "stowage"}
    assert (PACKAGING / f"{seen['desktop']}.desktop").is_file()


# The freedesktop menu spec's main categories: a launcher in two of them shows up twice in menus.
MAIN_CATEGORIES = {"AudioVideo", "Audio", "Video", "Development", "Education", "Game", "Graphics", "Network",
                   "Office", "Science", "Settings", "System", "Utility"}


def test_desktop_entry_is_valid_for_debian_12s_validator():
    entry = desktop_entry()
    # desktop-file-validate 0.26 (Debian 12) rejects Version=1.5 as unknown; 1.4 is the newest it knows.
    assert tuple(map(int, entry["Version"].split("."))) <= (1, 4)
    categories = [c for c in entry["Categories"].split(";") if c]
    assert len(set(categories) & MAIN_CATEGORIES) == 1, categories


def unescape_string(value: str) -> str:
    """A desktop file's string value as read (spec: \\s \\n \\t \\r \\\\ escapes); GLib refuses any other."""
    out, i = "", 0
    while i < len(value):
        if value[i] == "\\":
            out += {"s": " ", "n": "\n", "t": "\t", "r": "\r", "\\": "\\"}[value[i + 1]]
            i += 2
        else:
            out += value[i]
            i += 1
    return out


def unquote_exec(value: str) -> list[str]:
    """The argv a desktop environment runs for an Exec value: string escapes, then quoting, then %%."""
    value = unescape_string(value)
    args, current, quoted, i = [], None, False, 0
    while i < len(value):
        ch = value[i]
        if quoted and ch == "\\":
            assert value[i + 1] in '"`$\\', f"a stray backslash in {value!r}"
            current = (current or "") + value[i + 1]
            i += 1
        elif ch == '"':
            quoted = not quoted
            current = current or ""
        elif ch == " " and not quoted:
            if current is not None:
                args.append(current)
            current = None
        elif ch == "%":
            assert value[i + 1] == "%", f"a field code in {value!r}"
            current = (current or "") + "%"
            i += 1
        else:
            assert quoted or ch not in '"`$\\&|;<>()', f"{ch!r} must be quoted in {value!r}"
            current = (current or "") + ch
        i += 1
    assert not quoted, f"unbalanced quotes in {value!r}"
    return args + ([current] if current is not None else [])


def fake_gui(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    gui = folder / "stowage-gui"
    gui.write_text("#!/bin/sh\n")
    gui.chmod(0o755)
    return gui


def run_installer(tmp_path, *args, gui, cwd=None, path_dirs=()):
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "share"), "STOWAGE_GUI": str(gui),
           "PATH": os.pathsep.join([*map(str, path_dirs), os.environ["PATH"]])}
    return subprocess.run([str(PACKAGING / "install_desktop.sh"), *args], env=env, cwd=cwd, capture_output=True,
                          text=True)


def installed_entry(tmp_path) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str
    parser.read(tmp_path / "share" / "applications" / "stowage.desktop")
    return parser["Desktop Entry"]


@pytest.mark.parametrize("folder", ["plain", "dir with space", "R&D", "a|b", "100% local", 'say "hi"', "cost $5", "back\\slash"])
def test_the_installed_launcher_runs_the_script_whatever_its_path(tmp_path, folder):
    gui = fake_gui(tmp_path / folder)
    result = run_installer(tmp_path, gui=gui)
    assert result.returncode == 0, result.stderr
    entry = installed_entry(tmp_path)
    assert unquote_exec(entry["Exec"]) == [str(gui)]
    assert unescape_string(entry["TryExec"]) == str(gui)
    if shutil.which("desktop-file-validate"):
        check = subprocess.run(["desktop-file-validate", str(tmp_path / "share" / "applications" / "stowage.desktop")],
                               capture_output=True, text=True)
        assert check.returncode == 0 and not check.stdout.strip(), check.stdout


def test_a_relative_script_path_is_made_absolute(tmp_path):
    gui = fake_gui(tmp_path / "venv" / "bin")
    result = run_installer(tmp_path, gui=Path("venv/bin/stowage-gui"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert unquote_exec(installed_entry(tmp_path)["Exec"]) == [str(gui)]


def test_a_script_that_is_not_there_is_refused_and_nothing_is_written(tmp_path):
    result = run_installer(tmp_path, gui=tmp_path / "nowhere" / "stowage-gui")
    assert result.returncode != 0 and "installed" not in result.stdout
    assert "stowage-gui" in result.stderr
    assert not (tmp_path / "share" / "applications" / "stowage.desktop").exists()


def test_uninstall_leaves_no_caches_behind(tmp_path):
    # Stand-ins for the cache tools, writing their cache files where the real ones do.
    tools = tmp_path / "tools"
    tools.mkdir()
    for name, cache in (("update-desktop-database", "mimeinfo.cache"), ("gtk-update-icon-cache", "icon-theme.cache")):
        script = tools / name
        script.write_text(f'#!/bin/sh\nfor a; do d=$a; done\n[ -d "$d" ] && touch "$d/{cache}"\n')
        script.chmod(0o755)
    gui = fake_gui(tmp_path / "bin")
    assert run_installer(tmp_path, gui=gui, path_dirs=[tools]).returncode == 0
    share = tmp_path / "share"
    assert (share / "applications" / "mimeinfo.cache").exists() and (share / "icons" / "hicolor" / "icon-theme.cache").exists()
    result = run_installer(tmp_path, "--uninstall", gui=gui, path_dirs=[tools])
    assert result.returncode == 0, result.stderr
    assert [p for p in share.rglob("*") if not p.is_dir()] == []


def test_the_installer_inside_a_bundle_launches_the_bundle(tmp_path):
    # The layout PyInstaller's COLLECT writes for stowage.spec: the executable beside _internal/ (the DATAS).
    bundle = tmp_path / "dist" / "stowage"
    internal = bundle / "_internal"
    for src, dst in spec_constants()["DATAS"]:
        if src.startswith(("packaging/", "assets/icons")):
            target = internal / dst / Path(src).name if (ROOT / src).is_file() else internal / dst
            target.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copy2 if (ROOT / src).is_file() else shutil.copytree)(ROOT / src, target)
    gui = fake_gui(bundle).rename(bundle / "stowage")
    env = {k: v for k, v in os.environ.items() if k != "STOWAGE_GUI"} | {"XDG_DATA_HOME": str(tmp_path / "share"),
                                                                         "PATH": "/usr/bin:/bin"}
    result = subprocess.run(["sh", str(internal / "packaging" / "install_desktop.sh")], env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    assert unquote_exec(installed_entry(tmp_path)["Exec"]) == [str(gui)]


def test_the_wheel_installs_one_top_level_package(tmp_path):
    # app/, engine/, kernels/ and assets/ install as stowage.*: a top-level `kernels` would overwrite Hugging Face's
    # (which transformers imports by that name), and `app`/`engine` are as likely to clash.
    import sys
    import zipfile

    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                          str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("stowage-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"stowage", "stowage_entry.py"}
    assert "stowage/__init__.py" not in names  # a namespace package: no folder of the checkout shadows it
    for needed in ("stowage/engine/cli/__main__.py", "stowage/kernels/csrc/decode_layer.c",
                   "stowage/assets/demo-model/model.safetensors", "stowage/app/main.py"):
        assert needed in names


def test_the_checkout_is_not_on_sys_path():
    # the tests import the installed package; the checkout's folders are not importable under their own names
    # (pytest runs with -P and --import-mode=importlib), so Hugging Face's `kernels` is the one transformers finds
    import importlib.util

    for name in ("app", "engine", "kernels"):
        spec = importlib.util.find_spec(name)
        places = [*(spec.submodule_search_locations or []), spec.origin] if spec else []
        assert ROOT / name not in [Path(p) if Path(p).is_dir() else Path(p).parent for p in places if p], (
            f"{name} resolves to the checkout: {spec}")
