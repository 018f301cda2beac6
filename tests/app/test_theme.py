"""Issue 30, item 4 (the settings side): the window follows a dark system palette, View ▸ Theme chooses light, dark
or the system's, and the graphs, plan bar and notes follow the choice."""

import pytest
from PySide6.QtWidgets import QApplication

from stowage.app import theme


@pytest.fixture(autouse=True)
def system_theme_after():
    yield
    theme.apply("system")


def is_dark_brush(plot) -> bool:
    return plot.backgroundBrush().color().lightness() < 128


def test_the_window_follows_a_dark_system_palette(app_driver, tiny_model_dir):
    window = app_driver.open(tiny_model_dir)
    app_driver.wait_planned(window)
    assert not is_dark_brush(window.graph.ram_plot)
    QApplication.setPalette(theme.dark_palette())  # what the platform does when the desktop turns dark
    assert theme.is_dark() and is_dark_brush(window.graph.ram_plot)
    panel = window.settings_panel
    assert theme.DARK.muted in panel.picker.info.styleSheet()  # a note readable on the dark panel
    assert theme.DARK.ok in panel.plan_message.styleSheet()
    assert theme.DARK.plot_foreground in window.graph.ram_plot.getPlotItem().titleLabel.text
    image = panel.plan_bar.grab().toImage()  # the bar's free part is drawn dark too, not a white strip
    free = image.pixelColor(image.width() - 3, 30)
    assert free.lightness() < 128


def test_view_theme_chooses_dark_or_light_and_is_kept(app_driver, tiny_model_dir):
    window = app_driver.open(tiny_model_dir)
    actions = window.theme_actions
    assert set(actions) == {"system", "light", "dark"} and actions["system"].isChecked()
    actions["dark"].trigger()
    assert theme.is_dark() and is_dark_brush(window.graph.ram_plot)
    assert window.qsettings.value("theme") == "dark"
    window.close()
    again = app_driver.open(tiny_model_dir)
    assert again.theme_actions["dark"].isChecked() and theme.is_dark()  # kept for the next start
    again.theme_actions["light"].trigger()
    assert not theme.is_dark() and not is_dark_brush(again.graph.ram_plot) and actions["dark"] is not None
    assert theme.LIGHT.muted in again.settings_panel.picker.info.styleSheet()
