"""Issue 30, item 9: a 1024x640 window gives the chat a fair share and keeps Load in sight."""


def test_at_1024_by_640_the_chat_has_a_fair_share_and_load_is_in_sight(app_driver, tiny_model_dir, qtbot):
    window = app_driver.open(tiny_model_dir)
    window.resize(1024, 640)
    app_driver.wait_planned(window)
    qtbot.waitUntil(lambda: window.width() == 1024)
    panel = window.settings_panel
    assert window.chat.width() >= 0.4 * window.width() and window.chat.width() >= panel.width()
    load = panel.load_button
    assert load.isVisible() and not load.visibleRegion().isEmpty()
    bottom_right = load.mapTo(window, load.rect().bottomRight())
    assert window.rect().contains(bottom_right)  # not scrolled out of sight
    if not window.stats.gpus:  # no placeholder for a GPU there is not
        assert not window.graph.vram_plot.isVisible()
        assert window.graph.ram_plot.width() > 0.9 * window.graph.width()
