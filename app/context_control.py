"""Context size: a log-feel slider whose top is the largest context that fits, plus a number box."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QHBoxLayout, QSlider, QSpinBox, QWidget

from .context_scale import MIN_CONTEXT, SLIDER_STEPS, position_to_tokens, snap, tokens_to_position


class ContextControl(QWidget):
    """Emits `changed(tokens)` on every slider move or number edit.

    The number box goes up to the model's maximum so a user can ask for more than fits (the forecast
    then says by how much); the slider ends at what fits.
    """

    changed = Signal(int)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.block_size = 16
        self.lo, self.slider_max, self.model_max = MIN_CONTEXT, MIN_CONTEXT, MIN_CONTEXT
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setRange(0, SLIDER_STEPS)
        self.slider.setPageStep(SLIDER_STEPS // 10)
        self.slider.setAccessibleName("Context size")
        self.spin = QSpinBox()
        self.spin.setSuffix(" tokens")
        self.spin.setGroupSeparatorShown(True)
        self.spin.setKeyboardTracking(False)  # typing "8192" should not plan 8, 81, 819 on the way
        self.spin.setAccessibleName("Context size in tokens")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.slider, 1)
        layout.addWidget(self.spin)
        self.slider.valueChanged.connect(self._slider_moved)
        self.spin.valueChanged.connect(self._spin_changed)
        self._tokens = MIN_CONTEXT

    @property
    def tokens(self) -> int:
        return self._tokens

    def set_range(self, max_fit_tokens: int, model_max_tokens: int, block_size: int) -> None:
        """Slider from 512 (or less when even that does not fit) to `max_fit_tokens`."""
        self.block_size = block_size
        self.model_max = model_max_tokens
        self.lo = min(MIN_CONTEXT, model_max_tokens)
        self.slider_max = max(min(max_fit_tokens, model_max_tokens), self.lo)
        self.slider.setEnabled(max_fit_tokens > self.lo)
        self.spin.blockSignals(True)
        self.spin.setRange(block_size, model_max_tokens)
        self.spin.setSingleStep(block_size)
        self.spin.blockSignals(False)
        self._show(self._tokens)

    def set_tokens(self, tokens: int) -> None:
        """Set the value without emitting (restoring saved settings)."""
        self._tokens = snap(tokens, self.block_size, self.block_size, self.model_max)
        self._show(self._tokens)

    def _show(self, tokens: int) -> None:
        for widget in (self.slider, self.spin):
            widget.blockSignals(True)
        self.slider.setValue(tokens_to_position(tokens, self.lo, self.slider_max))
        self.spin.setValue(tokens)
        for widget in (self.slider, self.spin):
            widget.blockSignals(False)

    def _slider_moved(self, position: int) -> None:
        self._set(position_to_tokens(position, self.lo, self.slider_max, self.block_size))

    def _spin_changed(self, tokens: int) -> None:
        self._set(snap(tokens, self.block_size, self.block_size, self.model_max))
        self._show(self._tokens)

    def _set(self, tokens: int) -> None:
        if tokens == self._tokens:
            return
        self._tokens = tokens
        self.spin.blockSignals(True)
        self.spin.setValue(tokens)
        self.spin.blockSignals(False)
        self.changed.emit(tokens)
