"""Live VRAM and RAM graphs, with the plan's prediction as a dashed line next to what is measured."""

from __future__ import annotations

import math

import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import QGraphicsItem, QHBoxLayout, QLabel, QStackedLayout, QWidget

from .memory_stats import MemoryStats, RingBuffer, Sample

GIB = 1024**3
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2")


def _title(name: str, entries: list[tuple[str, str, bool]]) -> str:
    """The plot's title with its legend in it, (label, colour, dashed) each: a legend inside the plot covered the lines."""
    keys = "".join(f"&nbsp;&nbsp;<span style='color:{color}'>{'╌╌' if dashed else '━━'}</span>&nbsp;{label}"
                   for label, color, dashed in entries)
    return f"<span style='color:#333'>{name}</span><span style='color:#555'>{keys}</span>"


def _plot(title: str, history_s: float) -> pg.PlotWidget:
    plot = pg.PlotWidget(background="w")
    plot.setTitle(title, size="9pt")
    plot.setLabel("left", "GiB")
    plot.setLabel("bottom", "seconds ago")
    plot.showGrid(x=True, y=True, alpha=0.2)
    plot.setMouseEnabled(x=False, y=False)
    plot.setXRange(-history_s, 0, padding=0)  # a fixed window: the time axis does not jump as it fills
    plot.setMenuEnabled(False)
    plot.hideButtons()
    plot.setMinimumHeight(120)
    plot.getPlotItem().setContentsMargins(0, 4, 14, 0)  # room for the "0" tick at the right edge
    for name in ("left", "bottom"):
        # Each new sample repaints the curve's rectangle, which touches the axes; from a pixmap cache
        # that is a copy instead of laying out the tick text again (docs/benchmarks.md).
        plot.getAxis(name).setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)
    return plot


class MemoryGraph(QWidget):
    """Samples `stats` from a QTimer into ring buffers and redraws; `sampled` fires after each sample."""

    sampled = Signal(object)  # Sample

    def __init__(self, stats: MemoryStats, interval_ms: int = 250, history_s: float = 300.0, parent=None):
        super().__init__(parent)
        self.stats = stats
        capacity = max(2, int(history_s * 1000 / interval_ms))
        self.times = RingBuffer(capacity)
        self.ram_used = RingBuffer(capacity)
        self.process = RingBuffer(capacity)
        self.gpu_used = [RingBuffer(capacity) for _ in stats.gpus]

        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)

        # VRAM: a plot when NVML sees GPUs, otherwise a plain sentence in its place.
        self.vram_plot = _plot(_title("VRAM", [(f"GPU {g.index}", c, False) for g, c in zip(stats.gpus, COLORS)]
                                       + [("predicted", "#555", True)]), history_s)
        self.vram_curves = []
        self.vram_predicted = []
        for gpu, color in zip(stats.gpus, COLORS):
            self.vram_curves.append(self.vram_plot.plot(pen=pg.mkPen(color, width=2), name=f"GPU {gpu.index} used"))
            line = pg.InfiniteLine(angle=0, pen=pg.mkPen(color, width=1.5, style=Qt.PenStyle.DashLine))
            line.setVisible(False)
            self.vram_plot.addItem(line)
            self.vram_predicted.append(line)
        if stats.gpus:
            self.vram_plot.setYRange(0, max(g.total_bytes for g in stats.gpus) / GIB)
        self.vram_note = QLabel(stats.gpu_note or "No NVIDIA GPU")
        self.vram_note.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.vram_note.setStyleSheet("color: #666; border: 1px solid #ccc; background: white;")
        vram_box = QStackedLayout()
        vram_box.addWidget(self.vram_plot)
        vram_box.addWidget(self.vram_note)
        vram_box.setCurrentWidget(self.vram_plot if stats.gpus else self.vram_note)
        layout.addLayout(vram_box, 1)

        self.ram_plot = _plot(_title(f"RAM ({stats.ram_total_bytes / GIB:.0f} GiB)", [
            ("system used", "#1f77b4", False), ("Stowage", "#2ca02c", False), ("Stowage predicted", "#d62728", True)]),
            history_s)
        self.ram_curve = self.ram_plot.plot(pen=pg.mkPen("#1f77b4", width=2), name="system used")
        self.process_curve = self.ram_plot.plot(pen=pg.mkPen("#2ca02c", width=2), name="Stowage")
        self.ram_predicted = pg.InfiniteLine(angle=0, pen=pg.mkPen("#d62728", width=1.5, style=Qt.PenStyle.DashLine))
        self.ram_predicted.setVisible(False)
        self.ram_plot.addItem(self.ram_predicted)
        layout.addWidget(self.ram_plot, 1)
        # The y range is set by hand: autoranging moves the axis on every sample, and redrawing the
        # axis text costs far more per sample than a fixed axis (docs/benchmarks.md).
        self.ram_top_gib = 0.0

        self.timer = QTimer(self)
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self.update_now)
        self.timer.start()
        self.update_now()

    def set_prediction(self, process_bytes: float | None, gpu_bytes: dict[int, float] | None = None) -> None:
        """Draw the predicted level of this process's RAM and of each GPU's VRAM; None hides it."""
        self.ram_predicted.setVisible(process_bytes is not None)
        if process_bytes is not None:
            self.ram_predicted.setValue(process_bytes / GIB)
        gpu_bytes = gpu_bytes or {}
        for gpu, line in zip(self.stats.gpus, self.vram_predicted):
            value = gpu_bytes.get(gpu.index)
            line.setVisible(value is not None)
            if value is not None:
                line.setValue(value / GIB)

    def predict(self, plan) -> None:
        """Dashed lines: where the engine's RAM and each GPU's VRAM should sit with `plan` loaded (None: hidden)."""
        if plan is None or not plan.fits:
            self.set_prediction(None)
            return
        sample = self.stats.sample()
        cpu = sum(d.total_bytes for d in plan.devices if d.device == "cpu")
        gpus = {}
        for d in plan.devices:
            if d.device.startswith("cuda:"):
                index = int(d.device.removeprefix("cuda:"))
                used = sample.gpu_used_bytes[index] if index < len(sample.gpu_used_bytes) else 0
                gpus[index] = used + d.total_bytes
        self.set_prediction(sample.process_bytes + cpu, gpus)

    def update_now(self) -> None:
        sample = self.stats.sample()
        self.add_sample(sample)
        self.sampled.emit(sample)

    def add_sample(self, sample: Sample) -> None:
        self.times.append(sample.time_s)
        self.ram_used.append(sample.ram_used_bytes / GIB)
        self.process.append(sample.process_bytes / GIB)
        for buffer, used in zip(self.gpu_used, sample.gpu_used_bytes):
            buffer.append(used / GIB)
        if not self.isVisible():
            return  # keep sampling while hidden so the history is whole when the window shows
        ago = self.times.values() - sample.time_s
        ram_used, process = self.ram_used.values(), self.process.values()
        self.ram_curve.setData(ago, ram_used)
        self.process_curve.setData(ago, process)
        predicted = self.ram_predicted.value() if self.ram_predicted.isVisible() else 0.0
        top = y_top(self.ram_top_gib, max(ram_used.max(), process.max(), predicted))
        if top != self.ram_top_gib:
            self.ram_top_gib = top
            self.ram_plot.setYRange(0, top, padding=0)
        for curve, buffer in zip(self.vram_curves, self.gpu_used):
            curve.setData(ago, buffer.values())


def y_top(current: float, needed: float) -> float:
    """The axis top for values up to `needed`: kept while it fits well, else the next step above 125 %."""
    if 0 < needed <= current * 0.95 and needed > current * 0.4:
        return current
    target = max(needed * 1.25, 0.25)
    for step in (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        if step >= target / 4:  # about four ticks
            return math.ceil(target / step) * step
    return target
