"""Context size: a log-feel slider whose top is the largest context that fits, plus a number box."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QSlider, QSpinBox, QVBoxLayout, QWidget

from . import theme
from .context_scale import MIN_CONTEXT, SLIDER_STEPS, position_to_tokens, snap, tokens_to_position

MAX_TYPED = 999_999_999  # the box takes any number up to this (no model reads more); the commit says what became of it


class TokenBox(QSpinBox):
    """A spin box whose arrows stay within [lo, hi] while typing may go past it (the control then explains)."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.lo, self.hi = MIN_CONTEXT, MIN_CONTEXT
        self.setRange(1, MAX_TYPED)

    def stepBy(self, steps: int) -> None:
        self.setValue(max(self.lo, min(self.hi, self.value() + steps * self.singleStep())))


class ContextControl(QWidget):
    """Emits `changed(tokens)` on every slider move or committed number (Enter, or leaving the box).

    The number box goes up to the model's maximum so a user can ask for more than fits (the forecast
    then says by how much); the slider ends at what fits. What is typed is checked only when it is
    committed, and `note` says when it was rounded to whole KV blocks or moved into range.
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
        self.spin = TokenBox()
        self.spin.setSuffix(" tokens")
        self.spin.setGroupSeparatorShown(True)
        self.spin.setKeyboardTracking(False)  # typing "8192" should not plan 8, 81, 819 on the way
        self.spin.setAccessibleName("Context size in tokens")
        self.note = QLabel()
        self.note.setWordWrap(True)
        theme.tint(self.note, "warning")
        self.note.hide()
        row = QHBoxLayout()
        row.addWidget(self.slider, 1)
        row.addWidget(self.spin)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        layout.addLayout(row)
        layout.addWidget(self.note)
        self.slider.valueChanged.connect(self._slider_moved)
        self.spin.valueChanged.connect(self._spin_changed)
        self._context_tokens = MIN_CONTEXT

    @property
    def context_tokens(self) -> int:
        return self._context_tokens

    def set_range(self, max_fit_tokens: int, model_max_tokens: int, block_size: int) -> None:
        """Slider from 512 (or less when even that does not fit) to `max_fit_tokens`."""
        self.block_size = block_size
        self.model_max = model_max_tokens
        self.lo = min(MIN_CONTEXT, model_max_tokens)
        self.slider_max = max(min(max_fit_tokens, model_max_tokens), self.lo)
        self.slider.setEnabled(max_fit_tokens > self.lo)
        self.spin.lo, self.spin.hi = self.lo, model_max_tokens
        self.spin.setSingleStep(block_size)
        self._set_note("")  # the other settings changed: a note about an earlier number no longer holds
        self._show(self._context_tokens)

    def set_context_tokens(self, tokens: int) -> None:
        """Set the value without emitting (restoring saved settings)."""
        self._context_tokens = snap(tokens, self.block_size, self.lo, self.model_max)
        self._set_note("")
        self._show(self._context_tokens)

    def _show(self, tokens: int) -> None:
        for widget in (self.slider, self.spin):
            widget.blockSignals(True)
        self.slider.setValue(tokens_to_position(tokens, self.lo, self.slider_max))
        self.spin.setValue(tokens)
        for widget in (self.slider, self.spin):
            widget.blockSignals(False)

    def _slider_moved(self, position: int) -> None:
        self._set_note("")
        self._set(position_to_tokens(position, self.lo, self.slider_max, self.block_size))

    def _spin_changed(self, typed: int) -> None:
        tokens = snap(typed, self.block_size, self.lo, self.model_max, up=True)
        self._set_note(self._adjustment(typed, tokens))
        self._set(tokens)
        self._show(self._context_tokens)

    def _adjustment(self, typed: int, tokens: int) -> str:
        """What the commit did to a typed number, in a sentence ('' when nothing)."""
        if typed > self.model_max:
            return f"This model reads at most {self.model_max:,} tokens: {typed:,} became {tokens:,}."
        if typed < self.lo:
            return (f"The context is at least {self.lo:,} tokens (the system prompt, a message and the reply "
                    f"need room): {typed:,} became {tokens:,}.")
        if tokens != typed:
            return f"Rounded {typed:,} to {tokens:,}: the KV cache holds whole blocks of {self.block_size} tokens."
        return ""

    def _set_note(self, text: str) -> None:
        self.note.setText(text)
        self.note.setVisible(bool(text))

    def _set(self, tokens: int) -> None:
        if tokens == self._context_tokens:
            return
        self._context_tokens = tokens
        self.spin.blockSignals(True)
        self.spin.setValue(tokens)
        self.spin.blockSignals(False)
        self.changed.emit(tokens)
