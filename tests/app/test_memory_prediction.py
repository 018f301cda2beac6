"""Issue 30, item 2: the RAM graph's "Stowage predicted" covers the process "Stowage" measures, from Load on."""

import numpy as np
import psutil

from stowage.app import paths
from stowage.app.memory_graph import GIB


def test_predicted_and_measured_ram_cover_the_engine_process_from_load_on(app_driver, qtbot):
    window = app_driver.open(paths.demo_model_dir())
    graph = window.graph
    app_driver.wait_planned(window)
    for _ in range(3):
        graph.update_now()
    assert np.isnan(graph.process_predicted.values()).all()  # a plan alone predicts nothing: no Load yet
    before = graph.process_predicted.num_values
    if window.stats.gpus:  # RAM alone: a CUDA context's host memory is no part of a plan
        window.settings_panel.gpu_auto.setChecked(False)
        window.settings_panel.gpu_layers.setValue(0)

    app_driver.load(window)
    child = psutil.Process(window.stats.pid)
    assert child.pid != psutil.Process().pid and child.ppid() == psutil.Process().pid  # the engine's child
    graph.update_now()
    predicted = graph.process_predicted.values()
    assert np.isnan(predicted[:before]).all() and np.isfinite(predicted[-1])  # from Load on, not across history
    plan_ram = sum(d.total_bytes for d in window.loaded_plan.devices if d.device == "cpu") / GIB
    measured = graph.process.values()[-1]
    # The prediction is the child's memory before the model plus the plan's RAM: the measured child lies between
    # the two (KV pages and workspace the model has not touched yet are not resident). The window's own memory,
    # which the child does not hold, is in neither.
    assert predicted[-1] - plan_ram <= measured <= predicted[-1]
    assert abs(measured - child.memory_info().rss / GIB) < 0.05

    window.settings_panel.unload_button.click()
    qtbot.waitUntil(lambda: window.loaded_dir is None, timeout=app_driver.timeout_ms)
    graph.update_now()
    assert np.isnan(graph.process_predicted.values()[-1])  # unloaded: the prediction ends
