"""One stacked bar per device: weights (a model of experts: its experts apart), KV cache, workspace and what stays free
of the budget."""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QRectF, QSize
from PySide6.QtGui import QColor, QPainter, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

from stowage.engine.units import format_bytes

from . import theme

SEGMENTS = (  # (attribute, legend, colour)
    ("weights_bytes", "weights", QColor("#4e79a7")),
    ("expert_bytes", "experts", QColor("#b07aa1")),
    ("kv_bytes", "KV", QColor("#f28e2b")),
    ("workspace_bytes", "workspace", QColor("#76b7b2")),
)
OVER = QColor("#d62728")
ROW_HEIGHT = 38


@dataclass(frozen=True)
class DeviceBar:
    label: str  # "GPU 0 (RTX 4090)" or "CPU RAM"
    weights_bytes: int  # all but the experts'
    kv_bytes: int
    workspace_bytes: int
    budget_bytes: int
    expert_bytes: int = 0  # the experts' weights placed here (a model of experts)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.expert_bytes + self.kv_bytes + self.workspace_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes


class PlanBar(QWidget):
    """Paints `bars`; a device over its budget shows the excess in red past the budget mark."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.bars: list[DeviceBar] = []
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setAccessibleName("Memory forecast")

    def set_bars(self, bars: list[DeviceBar]) -> None:
        self.bars = list(bars)
        self.setVisible(bool(self.bars))  # no model, no forecast: not even the legend
        self.setFixedHeight(self.sizeHint().height())
        self.setToolTip("\n".join(_describe(b) for b in self.bars))
        self.setAccessibleDescription(self.toolTip())
        self.update()

    def sizeHint(self) -> QSize:
        return QSize(300, 18 + ROW_HEIGHT * max(1, len(self.bars)))

    def paintEvent(self, event) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        width = self.width() - 2
        text_color = self.palette().color(self.foregroundRole())  # the palette's: readable in light and dark
        free = QColor(theme.colors().free)
        metrics = painter.fontMetrics()
        y = 0
        for bar in self.bars:
            # Scale so both the budget and an over-budget total fit the width.
            scale = width / max(bar.budget_bytes, bar.total_bytes, 1)
            painter.setPen(text_color)
            text = f"{bar.label}: {format_bytes(bar.total_bytes)} of {format_bytes(bar.budget_bytes)}"
            painter.drawText(1, y + metrics.ascent(), text)
            top = y + metrics.height() + 2
            height = ROW_HEIGHT - metrics.height() - 8
            painter.fillRect(QRectF(1, top, bar.budget_bytes * scale, height), free)
            x = 1.0
            for attr, _, color in SEGMENTS:
                w = getattr(bar, attr) * scale
                painter.fillRect(QRectF(x, top, w, height), color)
                x += w
            if not bar.fits:
                budget_x = 1 + bar.budget_bytes * scale
                painter.fillRect(QRectF(budget_x, top, x - budget_x, height), OVER)
                painter.setPen(QPen(text_color, 2))
                painter.drawLine(int(budget_x), top - 2, int(budget_x), top + height + 2)
            y += ROW_HEIGHT
        # Legend along the bottom.
        x = 1
        legend = [(name, color) for attr, name, color in _segments(self.bars)] + [("free", free), ("over", OVER)]
        for name, color in legend:
            painter.fillRect(QRectF(x, y + 4, 10, 10), color)
            painter.setPen(text_color)
            painter.drawText(x + 13, y + 4 + metrics.ascent() - 1, name)
            x += 13 + metrics.horizontalAdvance(name) + 10
        painter.end()


def _segments(bars: list[DeviceBar]) -> tuple:
    """The segments the bars show: experts only for a model of experts."""
    has_experts = any(b.expert_bytes for b in bars)
    return tuple(s for s in SEGMENTS if s[0] != "expert_bytes" or has_experts)


def _describe(bar: DeviceBar) -> str:
    parts = ", ".join(f"{name} {format_bytes(getattr(bar, attr))}" for attr, name, _ in SEGMENTS
                      if attr != "expert_bytes" or bar.expert_bytes)
    verdict = "fits" if bar.fits else f"over by {format_bytes(bar.total_bytes - bar.budget_bytes)}"
    return f"{bar.label}: {parts}; budget {format_bytes(bar.budget_bytes)} ({verdict})"
