"""Beside Send: what this chat's replies are held to, with a menu to change it: free text, any JSON object, JSON valid
under a schema file, and tools from a file. A file that does not hold up is a dialog saying why; nothing changes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QFileDialog, QMenu, QMessageBox, QToolButton

from stowage.engine.errors import InvalidArgumentError

from .reply_options import JSON_OBJECT, ReplyOptions, schema_format, tools_of

JSON_FILES = "JSON files (*.json);;All files (*)"


class ReplyOptionsButton(QToolButton):
    """`changed(ReplyOptions)` when the user picks another format or tools for this chat."""

    changed = Signal(object)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.options = ReplyOptions()
        self.error_box: QMessageBox | None = None  # the last file refused, while its dialog is open
        self.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        self.setAccessibleName("This chat's reply format and tools")
        self.setToolTip("Constrained decoding holds each reply to the format: a JSON reply always parses, and a tool "
                        "call's arguments are valid under its parameters (sent to a server as response_format and "
                        "tools)")
        menu = QMenu(self)
        self.text_action = menu.addAction("Reply as text", lambda: self._set(response_format=None, schema_file=""))
        self.json_action = menu.addAction("Reply as JSON (any object)",
                                          lambda: self._set(response_format=JSON_OBJECT, schema_file=""))
        menu.addAction("Reply as JSON valid under a schema file…", self._ask_schema)
        menu.addSeparator()
        menu.addAction("Tools the model may call, from a file…", self._ask_tools)
        self.no_tools_action = menu.addAction("No tools", lambda: self._set(tools=(), tool_choice=None, tools_file=""))
        for action in (self.text_action, self.json_action):
            action.setCheckable(True)
        self.setMenu(menu)
        self.set_options(ReplyOptions())

    def set_options(self, options: ReplyOptions) -> None:
        """Show the chat's options (no signal)."""
        self.options = options
        self.setText("Reply: " + (options.describe() or "text"))
        self.text_action.setChecked(options.response_format is None)
        self.json_action.setChecked(options.response_format == JSON_OBJECT)
        self.no_tools_action.setEnabled(bool(options.tools))

    def _set(self, **changes) -> None:
        self.set_options(replace(self.options, **changes))
        self.changed.emit(self.options)

    def _ask_schema(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "JSON Schema for this chat's replies", "", JSON_FILES)
        if path:
            self.choose_schema(path)

    def _ask_tools(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Tools this chat's model may call", "", JSON_FILES)
        if path:
            self.choose_tools(path)

    def choose_schema(self, path: str) -> bool:
        """Replies valid under the schema in the file at `path`, or a dialog saying why not; whether it was taken."""
        try:
            response_format = schema_format(path)
        except InvalidArgumentError as e:
            self._refuse("This schema cannot be used", str(e))
            return False
        self._set(response_format=response_format, schema_file=Path(path).name)
        return True

    def choose_tools(self, path: str) -> bool:
        """The tools in the file at `path` offered to the model, or a dialog saying why not; whether they were."""
        try:
            tools, choice = tools_of(path)
        except InvalidArgumentError as e:
            self._refuse("These tools cannot be used", str(e))
            return False
        self._set(tools=tools, tool_choice=choice, tools_file=Path(path).name)
        return True

    def _refuse(self, title: str, reason: str) -> None:
        # not exec(): the window (and a reply streaming in it) goes on while the dialog is open
        self.error_box = QMessageBox(QMessageBox.Icon.Warning, title, f"{reason[:1].upper()}{reason[1:]}.",
                                     QMessageBox.StandardButton.Ok, self)
        self.error_box.open()
