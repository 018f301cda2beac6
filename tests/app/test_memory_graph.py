import numpy as np

from stowage.app.memory_graph import GIB, MemoryGraph
from stowage.app.memory_stats import MemoryStats, RingBuffer


def test_ring_buffer_keeps_the_last_values_in_order():
    ring = RingBuffer(3)
    for value in range(5):
        ring.append(value)
    assert ring.values().tolist() == [2, 3, 4]
    assert ring.num_values == 3


def test_graph_receives_live_samples(qtbot):
    stats = MemoryStats()
    graph = MemoryGraph(stats, interval_ms=20)
    qtbot.addWidget(graph)
    graph.show()
    before = graph.process.num_values
    for _ in range(3):
        with qtbot.waitSignal(graph.sampled, timeout=2000) as blocker:
            pass
    sample = blocker.args[0]
    assert graph.process.num_values >= before + 3
    # Real numbers from psutil: this process holds some RAM, and the system uses at least that much.
    assert 0 < sample.process_bytes <= stats.ram_total_bytes
    assert 0 < sample.ram_used_bytes <= stats.ram_total_bytes
    _, ys = graph.process_curve.getData()
    assert len(ys) == graph.process.num_values
    assert np.isclose(ys[-1], graph.process.values()[-1])
    assert abs(ys[-1] - sample.process_bytes / GIB) < 1.0


def test_without_an_nvidia_gpu_the_vram_graph_is_hidden_and_ram_has_the_strip(qtbot):
    stats = MemoryStats()
    graph = MemoryGraph(stats)
    qtbot.addWidget(graph)
    graph.resize(1000, 170)
    graph.show()
    qtbot.waitExposed(graph)
    assert graph.vram_plot.isVisible() == bool(stats.gpus)
    if not stats.gpus:
        assert graph.ram_plot.width() > 0.9 * graph.width()  # no placeholder taking half the strip
        assert stats.device_summary().startswith("CPU only")  # the status bar says why


def test_the_predicted_line_starts_where_the_prediction_starts(qtbot):
    graph = MemoryGraph(MemoryStats(), interval_ms=10_000)  # samples only when the test adds them
    qtbot.addWidget(graph)
    graph.show()
    for _ in range(3):
        graph.update_now()
    graph.set_prediction(2 * GIB)
    for _ in range(2):
        graph.update_now()
    graph.set_prediction(None)
    graph.update_now()
    values = graph.process_predicted.values()
    assert np.isnan(values[:4]).all() and values[4:6].tolist() == [2.0, 2.0] and np.isnan(values[6])
    _, ys = graph.ram_predicted.getData()
    assert np.isnan(ys[0]) and ys[-2] == 2.0  # drawn from the samples: nothing across the earlier history


def test_y_axis_moves_only_when_the_data_leaves_it():
    from stowage.app.memory_graph import y_top

    top = y_top(0.0, 3.1)
    assert top >= 3.1 * 1.25 and top == y_top(top, 3.3)  # small changes keep the axis (and its cache)
    assert y_top(top, top) > top  # data at the top: grow
    assert y_top(top, 0.5) < top  # far below: shrink


def test_the_stats_follow_the_engines_process_and_come_back_when_it_ends():
    import os
    import subprocess
    import sys

    from stowage.app.memory_stats import MemoryStats

    stats = MemoryStats()
    child = subprocess.Popen([sys.executable, "-P", "-c", "import time; time.sleep(30)"])
    try:
        stats.follow(child.pid)
        assert stats.pid == child.pid and stats.sample().process_bytes > 0
    finally:
        child.kill()
        child.wait()
    assert stats.sample().process_bytes > 0 and stats.pid == os.getpid()  # it ended: this process again
