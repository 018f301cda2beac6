"""The mouse wheel scrolls the settings panel; it changes a box or slider only once the user focused it."""

from __future__ import annotations

from PySide6.QtCore import QCoreApplication, QEvent, QObject, Qt
from PySide6.QtWidgets import QAbstractScrollArea, QAbstractSlider, QAbstractSpinBox, QComboBox, QWidget

GUARDED = (QAbstractSpinBox, QAbstractSlider, QComboBox)


class WheelGuard(QObject):
    """An event filter: a wheel event over an unfocused control scrolls `area` instead."""

    def __init__(self, area: QAbstractScrollArea):
        super().__init__(area)
        self.area = area

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if event.type() == QEvent.Type.Wheel and isinstance(watched, QWidget) and not watched.hasFocus():
            # Handed on by hand: Qt passes an ignored wheel event to the parents only when the window
            # system sent it, and the area scrolls by the event's angle, not its position.
            QCoreApplication.sendEvent(self.area.viewport(), event)
            return True
        return False


def guard_wheel(area: QAbstractScrollArea) -> WheelGuard:
    """Guard every spin box, slider and combo box inside `area` (ones added later are not covered)."""
    guard = WheelGuard(area)
    for widget in area.widget().findChildren(QWidget):
        if isinstance(widget, GUARDED):
            widget.setFocusPolicy(Qt.FocusPolicy.StrongFocus)  # click or Tab focuses; the wheel does not
            widget.installEventFilter(guard)
    return guard
