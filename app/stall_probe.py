"""Measures how long the GUI event loop goes without running: the longest gap between timer ticks."""

from __future__ import annotations

import time

from PySide6.QtCore import QObject, QTimer


class StallProbe(QObject):
    """A fast QTimer; any tick that arrives late by more than its interval is time the GUI was frozen."""

    def __init__(self, interval_ms: int = 5, parent=None):
        super().__init__(parent)
        self.interval_s = interval_ms / 1000
        self.max_stall_s = 0.0
        self.num_ticks = 0
        self._last = None
        self._timer = QTimer(self)
        self._timer.setInterval(interval_ms)
        self._timer.timeout.connect(self._tick)

    def start(self) -> None:
        self.max_stall_s = 0.0
        self.num_ticks = 0
        self._last = time.perf_counter()
        self._timer.start()

    def stop(self) -> float:
        self._timer.stop()
        return self.max_stall_s

    def _tick(self) -> None:
        now = time.perf_counter()
        self.max_stall_s = max(self.max_stall_s, now - self._last - self.interval_s)
        self._last = now
        self.num_ticks += 1
