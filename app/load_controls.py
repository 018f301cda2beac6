"""Load / Unload (Connect, for a server's model), the load's progress with Cancel, and what is loaded."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QHBoxLayout, QLabel, QProgressBar, QPushButton, QVBoxLayout, QWidget

from . import theme


class LoadControls(QWidget):
    """The panel's buttons connect to its signals; the main window reports the load through show_*."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.load_button = QPushButton("Load")
        self.load_button.setDefault(False)
        self.unload_button = QPushButton("Unload")
        self.unload_button.setEnabled(False)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setTextVisible(True)
        self.cancel_button = QPushButton("Cancel")
        self.load_status = QLabel()
        self.load_status.setWordWrap(True)
        self.load_status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.template_label = QLabel()  # which chat template the loaded model formats chats with
        self.template_label.setWordWrap(True)
        theme.tint(self.template_label, "muted")
        self.template_label.setAccessibleName("Chat template")
        self.template_label.hide()
        self.pending = QLabel()  # settings changed since Load, which only the next Load applies
        self.pending.setWordWrap(True)
        theme.tint(self.pending, "warning")
        self.pending.hide()
        load_row = QHBoxLayout()
        load_row.addWidget(self.load_button)
        load_row.addWidget(self.unload_button)
        progress_row = QHBoxLayout()
        progress_row.addWidget(self.progress, 1)
        progress_row.addWidget(self.cancel_button)
        self.progress_widget = QWidget()
        self.progress_widget.setLayout(progress_row)
        progress_row.setContentsMargins(0, 0, 0, 0)
        self.progress_widget.hide()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(load_row)
        layout.addWidget(self.progress_widget)
        layout.addWidget(self.load_status)
        layout.addWidget(self.template_label)
        layout.addWidget(self.pending)
        self._progress: tuple[float, str] | None = None
        self._progress_timer = QTimer(self)
        self._progress_timer.setInterval(100)
        self._progress_timer.timeout.connect(self._draw_progress)

    def set_can_load(self, can_load: bool) -> None:
        """Load is offered when the plan fits (or a server's model is chosen), never while a load runs."""
        self.load_button.setEnabled(can_load and not self.progress_widget.isVisible())

    def show_pending(self, text: str) -> None:
        """Say what the next Load would change ('' hides it)."""
        self.pending.setText(text)
        self.pending.setVisible(bool(text))

    def show_loading(self, fraction: float, message: str) -> None:
        """Progress from the engine; drawn at most every 100 ms.

        QProgressBar.setValue repaints synchronously (~7 ms here), and a load reports once per layer.
        """
        self._progress = (fraction, message)
        if not self.progress_widget.isVisible():
            self.progress_widget.show()
            self.load_button.setEnabled(False)
            theme.tint(self.load_status, None)
            self.load_status.clear()
        if not self._progress_timer.isActive():
            self._draw_progress()
            self._progress_timer.start()

    def _draw_progress(self) -> None:
        if self._progress is None or not self.progress_widget.isVisible():
            self._progress_timer.stop()
            return
        fraction, message = self._progress
        self._progress = None
        self.progress.setFormat(f"{message} — %p%")
        self.progress.setValue(int(fraction * 1000))

    def show_loaded(self, text: str, template_source: str, can_load: bool) -> None:
        self.progress_widget.hide()
        self.template_label.setText(f"Chat template: {template_source}")
        self.template_label.setVisible(bool(template_source))
        theme.tint(self.load_status, "ok")
        self.load_status.setText(text)
        self.unload_button.setEnabled(True)
        self.load_button.setEnabled(can_load)

    def say(self, text: str, error: bool = False) -> None:
        """A line on what is loaded (a server that stopped answering), leaving the buttons as they are."""
        theme.tint(self.load_status, "error" if error else "ok")
        self.load_status.setText(text)

    def show_unloaded(self, text: str, error: bool, can_load: bool) -> None:
        self.progress_widget.hide()
        self.template_label.hide()
        theme.tint(self.load_status, "error" if error else "muted")
        self.load_status.setText(text)
        self.unload_button.setEnabled(False)
        self.load_button.setEnabled(can_load)
