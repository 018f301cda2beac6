"""The CPU threads setting (issue 16): a field of the model's settings, kept, and applied at the next Load."""

from __future__ import annotations

from dataclasses import replace

import pytest
from factory import cpu_plan

from stowage.app.model_settings import ModelSettings, load_model_settings, open_settings, save_model_settings
from stowage.app.settings_panel import SettingsPanel
from stowage.app.worker import EngineClient
from stowage.kernels import cpu_decode


def test_the_field_reads_and_shows_the_setting(qtbot, tmp_path):
    panel = SettingsPanel([])
    qtbot.addWidget(panel)
    assert panel.cpu_threads.value() == 0 and panel.cpu_threads.specialValueText() == "Auto"
    panel._show_settings(replace(ModelSettings(), cpu_threads=1))
    assert panel.cpu_threads.value() == 1 and panel._read_settings().cpu_threads == 1
    settings = open_settings()
    save_model_settings(settings, tmp_path, replace(ModelSettings(), cpu_threads=3))
    assert load_model_settings(settings, tmp_path).cpu_threads == 3


@pytest.mark.skipif(cpu_decode.current() is None, reason="no native decode library here")
def test_a_load_in_process_runs_the_native_step_on_that_many_threads(qtbot, tiny_model_dir):
    client = EngineClient(use_process=False)
    before = cpu_decode.current().decode_num_threads()
    try:
        with qtbot.waitSignal(client.worker.loaded, timeout=60_000):
            client.load(str(tiny_model_dir), cpu_plan(tiny_model_dir, 256), threads=1)
        assert cpu_decode.current().decode_num_threads() == 1
    finally:
        client.shutdown()
        cpu_decode.set_threads(before)
