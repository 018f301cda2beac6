"""The context number box as a person types into it: whole numbers while typing, rounding said on commit."""

import pytest
from PySide6.QtCore import Qt
from PySide6.QtTest import QTest

from stowage.app.context_control import ContextControl


@pytest.fixture
def control(qtbot):
    control = ContextControl()
    qtbot.addWidget(control)
    control.show()
    return control


def type_tokens(control, text: str) -> list[str]:
    """Select the box's text, type `text` key by key, press Enter; what the box showed after each key."""
    edit = control.spin.lineEdit()
    control.spin.setFocus()
    edit.selectAll()
    shown = []
    for key in text:
        QTest.keyClicks(edit, key)
        shown.append(edit.text().removesuffix(" tokens"))
    QTest.keyClick(edit, Qt.Key.Key_Return)
    return shown


def test_typing_ten_thousand_gives_ten_thousand(control):
    control.set_range(20_000, 32_768, 16)
    control.set_context_tokens(1024)
    changed = []
    control.changed.connect(changed.append)
    assert type_tokens(control, "10000") == ["1", "10", "100", "1000", "10000"]
    assert control.context_tokens == 10_000 and changed == [10_000]
    assert control.note.isHidden()  # nothing was rounded


def test_a_number_past_the_models_maximum_is_typed_in_full_then_capped_and_said(control):
    control.set_range(8192, 8192, 16)
    control.set_context_tokens(1024)
    assert type_tokens(control, "10000")[-1] == "10000"  # the fifth digit is not refused
    assert control.context_tokens == 8192
    assert control.note.isVisible() and "8,192" in control.note.text() and "10,000" in control.note.text()


def test_rounding_to_whole_blocks_is_said(control):
    control.set_range(8192, 8192, 16)
    control.set_context_tokens(1024)
    type_tokens(control, "3000")
    assert control.context_tokens == 3008
    assert control.note.isVisible() and "3,008" in control.note.text() and "16" in control.note.text()
    control.slider.setValue(0)  # the slider only ever gives whole blocks: the note goes
    assert control.note.isHidden()
    type_tokens(control, "1000")  # 62.5 blocks: up to 63, never down (the user asked for at least 1,000)
    assert control.context_tokens == 1008 and "1,008" in control.note.text()


def test_less_than_the_minimum_is_refused_and_said(control):
    control.set_range(8192, 8192, 16)
    control.set_context_tokens(1024)
    type_tokens(control, "16")
    assert control.context_tokens == 512
    assert control.spin.value() == 512
    assert control.note.isVisible() and "512" in control.note.text()


def test_ten_million_is_typed_in_full_and_said(control):
    control.set_range(8192, 32_768, 16)
    control.set_context_tokens(1024)
    assert type_tokens(control, "10000000")[-1].replace(",", "") == "10000000"  # the eighth digit is not refused
    assert control.context_tokens == 32_768
    assert "10,000,000" in control.note.text() and "32,768" in control.note.text()
    control.set_range(4096, 32_768, 16)  # another setting moved the slider's top: the old note goes
    assert control.note.isHidden()
