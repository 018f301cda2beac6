"""The context slider and the live forecast, on a tiny real model and budgets stated by the test."""

import math

import pytest

from stowage.app.context_scale import SLIDER_STEPS
from stowage.app.forecast import Forecast
from stowage.app.model_settings import ModelSettings
from stowage.app.settings_panel import SettingsPanel
from stowage.engine.planning.budgets import given_budgets
from stowage.engine.planning.inspect import inspect
from stowage.engine.planning.plan import PlanRequest, max_context, plan


@pytest.fixture
def forecast(tiny_model_dir):
    info = inspect(tiny_model_dir)
    # RAM for everything at 2,048 tokens plus 1 MB: the largest context that fits lies between 2,048 and
    # the model's 4,096, so the slider's top is the planner's answer, not the model's limit.
    at_2048 = plan(info, PlanRequest(2048), given_budgets([], 10**9, ram_reserve_bytes=0)).devices[-1].total_bytes
    return Forecast(info, given_budgets([], at_2048 + 1_000_000, ram_reserve_bytes=0))


@pytest.fixture
def panel(qtbot, forecast):
    panel = SettingsPanel([])
    qtbot.addWidget(panel)
    panel.resize(420, 900)
    panel.show()
    panel.set_model(forecast, ModelSettings(context_tokens=1024))
    return panel


def test_slider_top_is_the_planners_max_context(panel, forecast):
    expected = max_context(forecast.info, PlanRequest(1024), forecast.budgets(panel.settings))
    assert 2048 < expected < 4096
    assert panel.max_fit_tokens == expected
    panel.context.slider.setValue(SLIDER_STEPS)
    assert panel.context.context_tokens == expected
    assert panel.settings.context_tokens == expected
    assert panel.plan.fits
    assert f"{expected:,}" in panel.max_label.text()


def test_slider_moves_change_the_forecast(panel, qtbot):
    panel.context.slider.setValue(0)
    assert panel.context.context_tokens == 512
    kv_small = panel.plan_bar.bars[0].kv_bytes
    with qtbot.waitSignal(panel.plan_changed) as blocker:
        panel.context.slider.triggerAction(panel.context.slider.SliderAction.SliderPageStepAdd)
    bigger = blocker.args[0]
    assert bigger.context_tokens > 512 and bigger.context_tokens % 16 == 0
    assert panel.plan_bar.bars[0].kv_bytes > kv_small
    assert panel.plan_bar.bars[0].kv_bytes == bigger.device("cpu").kv_bytes


def test_a_context_beyond_the_fit_is_shown_as_not_fitting(panel, qtbot):
    panel.context.spin.setValue(4096)  # the number box goes to the model's maximum
    assert panel.settings.context_tokens == 4096
    assert not panel.plan.fits
    assert not panel.plan_bar.bars[0].fits
    assert "largest context that fits" in panel.plan_message.text()
    assert not panel.load_button.isEnabled()
    assert panel.context.slider.value() == SLIDER_STEPS  # pinned at the top


def test_ram_limit_lowers_the_slider_top(panel, forecast):
    before = panel.max_fit_tokens
    # The box steps in 0.01 GiB; the step just under the one-block (16-token) plan leaves no context that fits.
    at_16 = plan(forecast.info, PlanRequest(16), forecast.detected).devices[-1].total_bytes
    limit_gib = math.floor(at_16 / 1024**3 * 100) / 100
    panel.ram_limit.setValue(limit_gib)
    assert panel.settings.ram_limit_gib == pytest.approx(limit_gib)
    expected = max_context(forecast.info, PlanRequest(16), forecast.budgets(panel.settings))
    assert panel.max_fit_tokens == expected < before
    assert expected == 0
    assert "No context fits" in panel.max_label.text()
    assert not panel.plan.fits and not panel.load_button.isEnabled()
    panel.ram_limit.setValue(0)  # back to "available RAM"
    assert panel.settings.ram_limit_gib is None
    assert panel.max_fit_tokens == before



def _wheel(widget, steps: int = -1) -> None:
    """One notch of the mouse wheel over `widget`'s centre, as the window system delivers it."""
    from PySide6.QtCore import QPoint, QPointF, Qt
    from PySide6.QtGui import QWheelEvent
    from PySide6.QtWidgets import QApplication

    centre = QPointF(widget.rect().center())
    event = QWheelEvent(centre, QPointF(widget.mapToGlobal(widget.rect().center())), QPoint(0, 0),
                        QPoint(0, 120 * steps), Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier,
                        Qt.ScrollPhase.NoScrollPhase, False)
    QApplication.sendEvent(widget, event)


def test_the_wheel_scrolls_the_panel_instead_of_changing_settings(panel, qtbot):
    panel.resize(420, 300)  # shorter than its content: the panel scrolls
    qtbot.wait(10)
    bar = panel.scroll.verticalScrollBar()
    assert bar.maximum() > 0
    settings, saved = panel.settings, []
    panel.settings_changed.connect(saved.append)
    for widget in (panel.context.slider, panel.context.spin, panel.kv_dtype, panel.temperature, panel.sampling.top_k):
        panel.scroll.ensureWidgetVisible(widget)
        before = bar.value()
        _wheel(widget)
        assert not widget.hasFocus()
        assert bar.value() > before or bar.value() == bar.maximum(), f"the panel did not scroll over {widget}"
        bar.setValue(0)
    assert panel.settings == settings and saved == []
    # Once the user clicked (focused) a box, the wheel is theirs to change it.
    panel.temperature.setFocus()
    qtbot.waitUntil(panel.temperature.hasFocus)
    _wheel(panel.temperature, steps=1)
    assert panel.settings.sampling.temperature == pytest.approx(settings.sampling.temperature + 0.05)


def test_a_plan_that_does_not_fit_is_said_short_and_never_proposes_less_than_the_minimum(qtbot, tiny_model_dir):
    info = inspect(tiny_model_dir)
    # RAM for about 100 tokens: less than the 512 the context box starts at
    at_96 = plan(info, PlanRequest(96), given_budgets([], 10**9, ram_reserve_bytes=0)).devices[-1].total_bytes
    small = Forecast(info, given_budgets([], at_96, ram_reserve_bytes=0))
    panel = SettingsPanel([])
    qtbot.addWidget(panel)
    panel.show()
    panel.set_model(small, ModelSettings(context_tokens=1024))
    assert not panel.plan.fits and 0 < panel.plan.max_context_tokens < 512
    text = panel.plan_message.text()
    assert text.startswith("Not even 512 tokens fit") and f"{panel.plan.max_context_tokens:,}" not in text
    assert len(text) < 200 and panel.plan_message.toolTip() == panel.plan.error  # the whole reasoning on hover

    panel.set_model(Forecast(info, given_budgets([], 10**9, ram_reserve_bytes=0)), ModelSettings(context_tokens=1024))
    panel.context.spin.setValue(4096)
    roomy = panel.plan
    if not roomy.fits:  # the largest context is proposed when the box can take it
        assert f"{roomy.max_context_tokens:,} tokens" in panel.plan_message.text()


def test_the_kv_cache_labels_are_computed_from_the_models_dtype(panel, forecast):
    labels = [panel.kv_dtype.itemText(i) for i in range(panel.kv_dtype.count())]
    dtype = forecast.info.compute_dtype
    assert labels[0] == f"Same as the model ({dtype})"
    fp8 = labels[panel.kv_dtype.findData("fp8")]
    assert fp8 == {"float32": "fp8 (a quarter of the memory)", "bfloat16": "fp8 (half the memory)",
                   "float16": "fp8 (half the memory)"}[dtype]
    if dtype == "float32":
        assert labels[panel.kv_dtype.findData("float16")] == "float16 (half the memory)"
        assert labels[panel.kv_dtype.findData("float32")] == "float32"
    # ggml blocks: 34 (q8_0) or 18 (q4_0) bytes per 32 values along a head, against 2 or 4 bytes a value; a head
    # size that is not whole blocks cannot take them (the item is there, greyed)
    q4 = panel.kv_dtype.findData("q4_0")
    head_dim = forecast.info.config.head_dim
    if head_dim % 32:
        assert labels[q4] == f"q4_0 (not for a head size of {head_dim})"
        assert not panel.kv_dtype.model().item(q4).isEnabled()
    else:
        wide = forecast.info.kv_bytes_per_token(None) / forecast.info.kv_bytes_per_token("float32")
        assert labels[q4] == f"q4_0 ({18 / 128 / wide:.0%} of the memory)"


def test_the_context_note_is_not_cut_and_goes_when_other_settings_change(panel, qtbot):
    from PySide6.QtCore import Qt
    from PySide6.QtTest import QTest

    panel.resize(340, 900)
    edit = panel.context.spin.lineEdit()
    panel.context.spin.setFocus()
    edit.selectAll()
    QTest.keyClicks(edit, "10000000")
    assert edit.text().replace(",", "").startswith("10000000")  # no digit dropped
    QTest.keyClick(edit, Qt.Key.Key_Return)
    note = panel.context.note
    qtbot.waitUntil(lambda: note.isVisible() and note.height() >= note.heightForWidth(note.width()))
    assert "10,000,000" in note.text() and "4,096" in note.text()
    panel.kv_dtype.setCurrentIndex(panel.kv_dtype.findData("fp8"))
    assert note.isHidden()


def test_a_model_of_experts_says_so_and_places_its_experts_as_asked(qtbot, tmp_path):
    """Issue 28's app part: the model's line names its experts and the parameters a token reads; the bar shows the
    experts apart, on the GPU and in RAM; "CPU expert layers" keeps the last N layers' experts in RAM."""
    from moe_factory import make_moe_model

    from stowage.app import model_facts

    info = inspect(make_moe_model(tmp_path / "moe", "qwen3_moe"))
    everything = plan(info, PlanRequest(1024), given_budgets([10**10], 10**10, gpu_safety_bytes=0))
    gpu = everything.device("cuda:0")
    assert gpu.experts == (0, 1, 2)
    # a GPU that takes every layer's attention and the experts of one or two layers, not all three
    budgets = given_budgets([gpu.total_bytes - info.expert_bytes()[2] * 3 // 2], 10**10, gpu_safety_bytes=0,
                            ram_reserve_bytes=0)
    panel = SettingsPanel([])
    qtbot.addWidget(panel)
    panel.show()
    panel.set_model(Forecast(info, budgets), ModelSettings(context_tokens=1024))
    assert panel.model_info.text().endswith(
        f"\nMoE: 8 experts, 2 active, {model_facts.count(info.num_active_parameters)} of "
        f"{model_facts.count(info.num_parameters)} parameters read per token")
    assert info.num_active_parameters < info.num_parameters
    on_gpu = panel.plan.device("cuda:0").experts
    assert len(panel.plan.device("cuda:0").layers) == 3 and 0 < len(on_gpu) < 3
    gpu_bar, ram_bar = panel.plan_bar.bars
    assert gpu_bar.expert_bytes == sum(info.expert_bytes()[i] for i in on_gpu) and ram_bar.expert_bytes > 0
    assert gpu_bar.total_bytes == panel.plan.device("cuda:0").total_bytes  # the experts counted once
    assert "experts" in panel.plan_bar.toolTip()
    form = panel.memory_form
    assert form.isRowVisible(panel.expert_row) and panel.expert_auto.isEnabled()
    assert not panel.cpu_expert_layers.isEnabled() and panel.cpu_expert_layers.maximum() == 3

    panel.expert_auto.setChecked(False)
    panel.cpu_expert_layers.setValue(3)  # every layer's experts in RAM
    assert panel.settings.cpu_expert_layers == 3 and panel.plan.request.cpu_expert_layers == 3
    assert panel.plan.expert_devices == ("cpu",) * 3 and panel.plan_bar.bars[0].expert_bytes == 0
    panel.expert_auto.setChecked(True)
    assert panel.settings.cpu_expert_layers is None and panel.plan.device("cuda:0").experts == on_gpu


def test_a_dense_model_shows_no_expert_controls(panel):
    assert "MoE" not in panel.model_info.text() and not panel.memory_form.isRowVisible(panel.expert_row)
    assert "experts" not in panel.plan_bar.toolTip()


def test_parameter_counts_are_cut_to_one_decimal_as_model_cards_write_them():
    from stowage.app.model_facts import count

    # Qwen3-30B-A3B as inspect counts it: 30,532,122,624 parameters, 3,353,032,704 read per token
    assert (count(30_532_122_624), count(3_353_032_704)) == ("30.5 B", "3.3 B")
    assert (count(740_400_000), count(96_250), count(999), count(123_456_789_000)) == ("740 M", "96.2 K", "999",
                                                                                        "123 B")
