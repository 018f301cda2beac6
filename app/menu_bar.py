"""The menu bar (File, Edit, View, Help) and the About box: versions, and where Stowage keeps its files."""

from __future__ import annotations

import platform
import sys
from importlib import metadata

import PySide6
from PySide6.QtCore import Qt, qVersion
from PySide6.QtGui import QAction, QActionGroup, QKeySequence
from PySide6.QtWidgets import QMessageBox

from . import paths, theme
from .hub_dialog import open_hub_dialog


def _action(window, menu, text: str, slot, shortcut=None, tip: str = "") -> QAction:
    action = QAction(text, window)
    if shortcut is not None:
        action.setShortcut(QKeySequence(shortcut))
    if tip:
        action.setStatusTip(tip)
    action.triggered.connect(slot)
    menu.addAction(action)
    return action


def _toggle(window, menu, text: str, widget) -> QAction:
    action = QAction(text, window)
    action.setCheckable(True)
    action.setChecked(True)
    action.toggled.connect(widget.setVisible)
    menu.addAction(action)
    return action


def build_menus(window) -> None:
    """Fill `window.menuBar()`; the actions a test or a later change needs are kept on the window."""
    bar = window.menuBar()
    chats = window.conversations
    file = bar.addMenu("&File")
    window.new_chat_action = _action(window, file, "&New chat", chats.new_conversation, QKeySequence.StandardKey.New)
    _action(window, file, "&Open model folder…", window.settings_panel.picker.browse, "Ctrl+O",
            "A folder with config.json and *.safetensors, or with .gguf files")
    _action(window, file, "Open GG&UF file…", window.settings_panel.picker.browse_file, "Ctrl+Shift+G",
            "A .gguf model file")
    window.get_models_action = _action(window, file, "&Get models…", lambda: open_hub_dialog(window), "Ctrl+Shift+O",
                                       "Search the Hugging Face Hub; see what fits before downloading")
    window.settings_panel.picker.hub_action.triggered.connect(window.get_models_action.trigger)  # Open… ▸ its twin
    _action(window, file, "Add remote &server…", window.add_server_dialog, tip="An OpenAI-compatible server whose "
            "models join the model list")
    file.addSeparator()
    _action(window, file, "Export chat as &Markdown…", lambda: chats.export_dialog("md"))
    _action(window, file, "Export chat as &JSON…", lambda: chats.export_dialog("json"))
    file.addSeparator()
    window.quit_action = _action(window, file, "&Quit", window.close, "Ctrl+Q", "Close Stowage and free the model")

    edit = bar.addMenu("&Edit")
    # "\t" shows the key without taking it: the list itself handles F2 and Delete where it has focus.
    window.find_action = _action(window, edit, "&Find chats…", chats.find, QKeySequence.StandardKey.Find,
                                 "Search the titles and messages of all conversations")
    _action(window, edit, "&Rename chat\tF2", chats.rename_current)
    _action(window, edit, "&Delete chat…\tDel", chats.confirm_delete)
    edit.addSeparator()
    _action(window, edit, "Re&generate reply", window.chat.regenerate, "Ctrl+R")
    _action(window, edit, "&Stop reply\tEsc", window.chat.client.stop)

    view = bar.addMenu("&View")
    window.show_list_action = _toggle(window, view, "&Conversations", chats)
    window.show_settings_action = _toggle(window, view, "&Settings", window.settings_panel)
    window.show_graphs_action = _toggle(window, view, "Memory &graphs", window.graph)
    view.addSeparator()
    window.theme_actions = _theme_menu(window, view.addMenu("&Theme"))

    help_menu = bar.addMenu("&Help")
    window.about_action = _action(window, help_menu, "&About Stowage", lambda: show_about(window))


def _theme_menu(window, menu) -> dict[str, QAction]:
    """System (follow the desktop's palette), Light or Dark: applied at once and kept for the next start."""
    group = QActionGroup(window)
    actions = {}
    chosen = theme.stored(window.qsettings)
    for name, label in (("system", "&System"), ("light", "&Light"), ("dark", "&Dark")):
        action = QAction(label, window, checkable=True)
        action.setChecked(name == chosen)
        action.triggered.connect(lambda _=False, name=name: theme.choose(window.qsettings, name))
        group.addAction(action)
        menu.addAction(action)
        actions[name] = action
    return actions


def app_version() -> str:
    try:
        return metadata.version("stowage")
    except metadata.PackageNotFoundError:  # a bundle or a bare checkout carries no package metadata
        return "(development copy)"


def cpu_decode_state() -> str:
    """What runs the CPU decode step, once the engine has loaded its library (never built from the GUI thread)."""
    from stowage.kernels import cpu_decode

    if cpu_decode.library.cache_info().currsize == 0:
        return "not loaded yet (with the first model)"
    return cpu_decode.active()


def about_text(window) -> str:
    torch = sys.modules.get("torch")  # imported before the window shows (app/worker.py)
    lines = [
        f"Python {platform.python_version()}, PySide6 {PySide6.__version__} (Qt {qVersion()}), "
        f"torch {torch.__version__ if torch else 'not loaded'}, {platform.system()} {platform.machine()}",
        f"Devices: {window.stats.device_summary()}",
        f"CPU decode step: {cpu_decode_state()}",
        "",
        f"Conversations: {window.store.path or 'in memory only'}",
        f"Models folder (any model folder put here is listed): {paths.models_dir()}",
        f"Settings: {window.qsettings.fileName()}",
        f"Demo model: {paths.demo_model_dir()}",
    ]
    if window.store.warning:
        lines += ["", window.store.warning]
    return "\n".join(lines)


def show_about(window) -> None:
    """A non-blocking box, like the error dialogs: a reply keeps streaming behind it."""
    box = QMessageBox(QMessageBox.Icon.Information, "About Stowage", f"<b>Stowage {app_version()}</b>",
                      QMessageBox.StandardButton.Ok, window)
    box.setInformativeText(about_text(window))
    box.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)  # paths can be copied
    box.open()
    window.about_box = box
