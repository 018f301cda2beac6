"""The bar under a chat while a long prompt is read: tokens done of all, and about how long is left."""

from __future__ import annotations

import time

from PySide6.QtWidgets import QProgressBar


def format_seconds(seconds: float) -> str:
    """'about 12 s' / 'about 3 min': an estimate, said as one."""
    if seconds < 60:
        return f"about {max(1, round(seconds))} s"
    return f"about {round(seconds / 60)} min"


class PromptProgress(QProgressBar):
    """Shown from the first prefill chunk until the last; `begin()` when the prompt starts, `finish()` at its end."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setAccessibleName("Prompt progress")
        self.setTextVisible(True)
        self._started_at: float | None = None
        self.hide()

    def begin(self) -> None:
        """The prompt starts being read now (the time left is reckoned from here)."""
        self._started_at = time.monotonic()
        self.hide()

    def show_progress(self, done: int, total: int) -> None:
        """A chunk is done: `done` of `total` prompt tokens computed (the cached prefix not counted)."""
        if done >= total or total <= 0:
            self.hide()  # the first token follows at once
            return
        if self._started_at is None:
            self._started_at = time.monotonic()
        elapsed = time.monotonic() - self._started_at
        text = f"Reading the prompt: {done:,} / {total:,} tokens"
        if done > 0 and elapsed > 0:
            text += f" · {format_seconds(elapsed * (total - done) / done)} left"
        self.setRange(0, total)
        self.setValue(done)
        self.setFormat(text)
        self.show()

    def finish(self) -> None:
        self._started_at = None
        self.hide()
