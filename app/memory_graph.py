"""Live VRAM and RAM graphs, with the plan's prediction as a dashed line next to what is measured."""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import QGraphicsItem, QHBoxLayout, QWidget

from . import theme
from .memory_stats import MemoryStats, RingBuffer, Sample

GIB = 1024**3


def _title(name: str, entries: list[tuple[str, str, bool]], colors: theme.Colors) -> str:
    """The plot's title with its legend in it, (label, colour, dashed) each: a legend inside the plot covered the lines."""
    keys = "".join(f"&nbsp;&nbsp;<span style='color:{color}'>{'╌╌' if dashed else '━━'}</span>&nbsp;{label}"
                   for label, color, dashed in entries)
    return f"<span style='color:{colors.plot_foreground}'>{name}{keys}</span>"


def _plot(history_s: float) -> pg.PlotWidget:
    plot = pg.PlotWidget()
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
    """Samples `stats` from a QTimer into ring buffers and redraws; `sampled` fires after each sample.

    The predicted levels are series too, sampled with the measurements: a dashed line that starts where the
    load started and ends at the unload, never drawn across the history before it."""

    sampled = Signal(object)  # Sample

    def __init__(self, stats: MemoryStats, interval_ms: int = 250, history_s: float = 300.0, parent=None):
        super().__init__(parent)
        self.stats = stats
        capacity = max(2, int(history_s * 1000 / interval_ms))
        self.times = RingBuffer(capacity)
        self.ram_used = RingBuffer(capacity)
        self.process = RingBuffer(capacity)
        self.process_predicted = RingBuffer(capacity)  # NaN where nothing was loading or loaded
        self.gpu_used = [RingBuffer(capacity) for _ in stats.gpus]
        self.gpu_predicted = [RingBuffer(capacity) for _ in stats.gpus]
        self.predicted_process_bytes: float | None = None  # what the next samples predict (None: nothing)
        self.predicted_gpu_bytes: dict[int, float] = {}

        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)

        # VRAM: a plot when NVML sees GPUs; none at all otherwise (the status bar says "CPU only" and why).
        self.vram_plot = _plot(history_s)
        if not stats.gpus:
            self.vram_plot.hide()
        self.vram_curves, self.vram_predicted = [], []
        for gpu in stats.gpus:
            self.vram_curves.append(self.vram_plot.plot(name=f"GPU {gpu.index} used"))
            self.vram_predicted.append(self.vram_plot.plot(name=f"GPU {gpu.index} predicted", connect="finite"))
        if stats.gpus:
            self.vram_plot.setYRange(0, max(g.total_bytes for g in stats.gpus) / GIB)
        layout.addWidget(self.vram_plot, 1)  # hidden, it takes no room: RAM has the whole strip

        self.ram_plot = _plot(history_s)
        self.ram_curve = self.ram_plot.plot(name="system used")
        self.process_curve = self.ram_plot.plot(name="Stowage")
        self.ram_predicted = self.ram_plot.plot(name="Stowage predicted", connect="finite")
        layout.addWidget(self.ram_plot, 1)
        # The y range is set by hand: autoranging moves the axis on every sample, and redrawing the
        # axis text costs far more per sample than a fixed axis (docs/benchmarks.md).
        self.ram_top_gib = 0.0
        theme.watch(self, self._restyle)

        self.timer = QTimer(self)
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self.update_now)
        self.timer.start()
        self.update_now()

    def _restyle(self) -> None:
        """Backgrounds, axes, titles and line colours for the palette in use (light or dark)."""
        c = theme.colors()
        for plot in (self.vram_plot, self.ram_plot):
            plot.setBackground(c.plot_background)
            for name in ("left", "bottom"):
                axis = plot.getAxis(name)
                axis.setPen(c.plot_foreground)
                axis.setTextPen(c.plot_foreground)
        gpus = list(zip(self.stats.gpus, c.series))
        self.vram_plot.setTitle(_title("VRAM", [(f"GPU {g.index}", color, False) for g, color in gpus]
                                       + [("predicted", c.plot_foreground, True)], c), size="9pt")
        for (gpu, color), curve, line in zip(gpus, self.vram_curves, self.vram_predicted):
            curve.setPen(pg.mkPen(color, width=2))
            line.setPen(pg.mkPen(color, width=1.5, style=Qt.PenStyle.DashLine))
        system, process = c.series[0], c.series[2]
        self.ram_plot.setTitle(_title(f"RAM ({self.stats.ram_total_bytes / GIB:.0f} GiB)", [
            ("system used", system, False), ("Stowage", process, False), ("Stowage predicted", c.predicted, True)],
            c), size="9pt")
        self.ram_curve.setPen(pg.mkPen(system, width=2))
        self.process_curve.setPen(pg.mkPen(process, width=2))
        self.ram_predicted.setPen(pg.mkPen(c.predicted, width=1.5, style=Qt.PenStyle.DashLine))

    def set_prediction(self, process_bytes: float | None, gpu_bytes: dict[int, float] | None = None) -> None:
        """From the next sample on: the predicted RAM of the measured process(es) and VRAM used per GPU; None ends
        the prediction."""
        self.predicted_process_bytes = process_bytes
        self.predicted_gpu_bytes = dict(gpu_bytes or {}) if process_bytes is not None else {}

    def expect(self, plan, process_base_bytes: int) -> None:
        """A load of `plan` started in a process holding `process_base_bytes` before the model (the one the graphs
        measure): from now on predict that plus the plan's RAM, and each GPU's VRAM used now plus its share."""
        sample = self.stats.sample()
        cpu = sum(d.total_bytes for d in plan.devices if d.device == "cpu")
        gpus = {}
        for d in plan.devices:
            if d.device.startswith("cuda:"):
                index = int(d.device.removeprefix("cuda:"))
                used = sample.gpu_used_bytes[index] if index < len(sample.gpu_used_bytes) else 0
                gpus[index] = used + d.total_bytes
        self.set_prediction(process_base_bytes + cpu, gpus)

    def update_now(self) -> None:
        sample = self.stats.sample()
        self.add_sample(sample)
        self.sampled.emit(sample)

    def add_sample(self, sample: Sample) -> None:
        self.times.append(sample.time_s)
        self.ram_used.append(sample.ram_used_bytes / GIB)
        self.process.append(sample.process_bytes / GIB)
        predicted = self.predicted_process_bytes
        self.process_predicted.append(math.nan if predicted is None else predicted / GIB)
        for gpu, buffer, line, used in zip(self.stats.gpus, self.gpu_used, self.gpu_predicted, sample.gpu_used_bytes):
            buffer.append(used / GIB)
            line.append(self.predicted_gpu_bytes.get(gpu.index, math.nan) / GIB)
        if not self.isVisible():
            return  # keep sampling while hidden so the history is whole when the window shows
        ago = self.times.values() - sample.time_s
        ram_used, process = self.ram_used.values(), self.process.values()
        self.ram_curve.setData(ago, ram_used)
        self.process_curve.setData(ago, process)
        predicted = self.process_predicted.values()
        self.ram_predicted.setData(ago, predicted)
        top = y_top(self.ram_top_gib, max(ram_used.max(), process.max(), float(np.nanmax(predicted, initial=0.0))))
        if top != self.ram_top_gib:
            self.ram_top_gib = top
            self.ram_plot.setYRange(0, top, padding=0)
        for curve, buffer in zip(self.vram_curves, self.gpu_used):
            curve.setData(ago, buffer.values())
        for line, buffer in zip(self.vram_predicted, self.gpu_predicted):
            line.setData(ago, buffer.values())


def y_top(current: float, needed: float) -> float:
    """The axis top for values up to `needed`: kept while it fits well, else the next step above 125 %."""
    if 0 < needed <= current * 0.95 and needed > current * 0.4:
        return current
    target = max(needed * 1.25, 0.25)
    for step in (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        if step >= target / 4:  # about four ticks
            return math.ceil(target / step) * step
    return target
