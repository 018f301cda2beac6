"""Serve's settings: a port, other computers, sequences and a key that lasts, kept in QSettings; each change restarts
the app's engine child with them (real children on the tiny model, the official openai client)."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from processes import TIMEOUT_S, free_port, openai_client

from stowage.engine.planning.plan import PlanRequest
from stowage.app.model_settings import open_settings
from stowage.app.serve_settings import (
    ServeSettings, lan_address, load_serve_settings, save_serve_settings, url_for_others,
)

def restart(qtbot, window, change):
    """Make a change to Serve and wait for the engine child it restarts."""
    old_pid = window.client.worker.process.pid
    change()
    qtbot.waitUntil(lambda: window.loaded_dir is not None and window.client.worker.process is not None
                    and window.client.worker.process.pid != old_pid
                    and window.settings_panel.serve.endpoint is not None, timeout=TIMEOUT_S * 1000)
    return window.client.worker.process


def test_the_key_is_made_once_and_the_settings_are_kept():
    qsettings = open_settings()
    first = load_serve_settings(qsettings)
    assert first == ServeSettings(api_key=first.api_key) and len(first.api_key) >= 32  # defaults: off, 8080, 2
    assert load_serve_settings(qsettings).api_key == first.api_key  # generated once, then kept
    chosen = ServeSettings(on=True, port=9123, other_computers=True, num_seqs=3, api_key="k" * 40)
    save_serve_settings(qsettings, chosen)
    assert load_serve_settings(open_settings()) == chosen
    qsettings.setValue("serve_sequences", "999")  # an edited file: the defaults, the key kept
    assert load_serve_settings(qsettings) == ServeSettings(api_key="k" * 40)
    assert chosen.listen() == {"port": 9123, "host": "0.0.0.0", "api_key": "k" * 40}
    assert ServeSettings().listening() is None and ServeSettings().plan_seqs == 1 and chosen.plan_seqs == 3
    with pytest.raises(ValueError, match="API key"):
        ServeSettings(on=True)
    address = lan_address()
    shown = url_for_others("http://127.0.0.1:9123/v1", chosen)
    assert shown == (f"http://{address}:9123/v1" if address else "http://127.0.0.1:9123/v1")
    assert url_for_others("http://127.0.0.1:9123/v1", ServeSettings()) == "http://127.0.0.1:9123/v1"


def test_the_forecast_counts_the_kv_cache_of_every_sequence(app_driver, tiny_model_dir):
    window = app_driver.open(tiny_model_dir)
    app_driver.wait_planned(window)
    panel = window.settings_panel
    alone = panel.plan
    assert alone.num_seqs == 1
    panel.serve.sequences.setValue(3)  # off: the chat's one sequence still
    assert panel.plan.num_seqs == 1
    panel.serve.switch.click()
    assert panel.plan.num_seqs == 3 and panel.plan.kv_bytes == 3 * alone.kv_bytes


def test_each_setting_restarts_the_engine_with_it_and_is_remembered(app_driver, qtbot, tiny_model_dir):
    window = app_driver.open(tiny_model_dir)
    serve = window.settings_panel.serve
    port = free_port()
    serve.port.setValue(port)
    serve.switch.click()
    app_driver.load(window, context_tokens=256)
    key = serve.key.text()
    url = f"http://127.0.0.1:{port}/v1"
    assert serve.url.text() == url and window.loaded_plan.num_seqs == 2  # the default: the chat and one more

    # two sequences: two other programs' requests at once both complete
    two_kv = window.client.worker.process.server.plan()["devices"][-1]["kv_bytes"]
    assert two_kv == window.loaded_plan.kv_bytes

    def ask(prompt):
        reply = openai_client(url, key).chat.completions.create(
            model=tiny_model_dir.name, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0)
        return reply.choices[0].finish_reason

    with ThreadPoolExecutor(2) as pool:
        assert all(r in ("stop", "length") for r in pool.map(ask, ["Stowage plans", "The KV cache holds"]))

    # one sequence: planned again, the child's KV cache halves
    process = restart(qtbot, window, lambda: serve.sequences.setValue(1))
    assert window.loaded_plan.num_seqs == 1
    assert 2 * process.server.plan()["devices"][-1]["kv_bytes"] == 2 * window.loaded_plan.kv_bytes == two_kv
    # the plan's request crosses whole (serve --plan-request), its one sequence with it
    argv = open(f"/proc/{process.pid}/cmdline").read().split("\x00")
    assert PlanRequest.from_json(argv[argv.index("--plan-request") + 1]).num_seqs == 1

    # a new key: the old one is refused from now on
    restart(qtbot, window, serve.new_key.click)
    new_key = serve.key.text()
    assert new_key != key and window.qsettings.value("serve_key") == new_key
    with pytest.raises(openai.AuthenticationError):
        openai_client(url, key).models.list()
    assert openai_client(url, new_key).models.list().data[0].id == tiny_model_dir.name

    # other computers: every address, the key required; this machine still reaches it on loopback
    process = restart(qtbot, window, serve.others.click)
    assert "--host\x000.0.0.0\x00" in open(f"/proc/{process.pid}/cmdline").read()
    address = lan_address()
    assert serve.url.text() == (f"http://{address}:{port}/v1" if address else url)
    assert "Other computers" in serve.note.text()
    assert openai_client(serve.url.text(), new_key).models.list().data[0].id == tiny_model_dir.name
    with httpx.Client(trust_env=False) as plain:
        assert plain.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401

    window.close()
    again = app_driver.open(tiny_model_dir).settings_panel.serve
    assert again.settings == ServeSettings(on=True, port=port, other_computers=True, num_seqs=1, api_key=new_key)
