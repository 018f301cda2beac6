"""The Serve switch: another program (the official openai client) reaches the app's engine at the shown URL with the
shown key, and is refused without it; off, the engine listens for the app alone on its private Unix socket."""


import httpx
import openai
import pytest
from processes import TIMEOUT_S, free_port, openai_client

def wait_restarted(qtbot, window, old_pid):
    """Until a new engine child answers (Serve's changes restart it) and the window shows it loaded."""
    qtbot.waitUntil(lambda: window.loaded_dir is not None and window.client.worker.process is not None
                    and window.client.worker.process.pid != old_pid, timeout=TIMEOUT_S * 1000)


def test_serve_on_restarts_the_engine_at_the_port_with_the_kept_key_and_off_closes_it(app_driver, qtbot,
                                                                                       tiny_model_dir):
    window = app_driver.open(tiny_model_dir)
    serve = window.settings_panel.serve
    assert not serve.url.isVisible() and "Load a model" in serve.note.text()
    app_driver.load(window)
    worker = window.client.worker
    assert worker.process.server.base_url.startswith("unix:")  # off: the app's own engine on its private socket
    assert worker.endpoint is None and not serve.url.isVisible() and "this app alone" in serve.note.text()
    port = free_port()
    serve.port.setValue(port)  # off: kept, nothing restarts
    assert window.qsettings.value("serve_port") in (port, str(port)) and worker.endpoint is None

    old_pid = worker.process.pid
    serve.switch.click()
    assert "Restarting" in serve.note.text()
    wait_restarted(qtbot, window, old_pid)
    assert serve.url.isVisible() and serve.key.isVisible()
    url, key = serve.url.text(), serve.key.text()
    assert url == f"http://127.0.0.1:{port}/v1" and key == window.qsettings.value("serve_key") and len(key) >= 32
    assert f'"{tiny_model_dir.name}"' in serve.note.text()
    reply = openai_client(url, key).chat.completions.create(
        model=tiny_model_dir.name, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0)
    assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):  # 401
        openai_client(url, "not-the-key").models.list()
    with httpx.Client(trust_env=False) as plain:  # no key at all
        assert plain.get(url + "/models").status_code == 401
    # the app's own chat still works beside the other program
    window.settings_panel.max_tokens.setValue(3)
    assert app_driver.reply(window, lambda: app_driver.send(window, "Hi")).result.text

    # Serve off: the engine goes back to its private socket, so nothing answers at the port any more
    old_pid = worker.process.pid
    serve.switch.click()
    assert not serve.url.isVisible()
    wait_restarted(qtbot, window, old_pid)
    assert worker.process.server.base_url.startswith("unix:") and worker.endpoint is None
    with pytest.raises(openai.APIConnectionError):
        openai_client(url, key).models.list()
    assert window.qsettings.value("serve") in (False, "false")
    assert window.qsettings.value("serve_key") == key  # the key lasts: the same when Serve is on again


def test_the_switch_is_remembered_and_shows_the_next_engine_at_once(app_driver, qtbot, tiny_model_dir):
    window = app_driver.open(tiny_model_dir)
    serve = window.settings_panel.serve
    serve.switch.click()  # on before anything is loaded
    serve.port.setValue(0)  # any free port
    key = serve.key.text()
    assert serve.key.isVisible() and len(key) >= 32 and not serve.url.isVisible()
    window.close()
    again = app_driver.open(tiny_model_dir)
    serve = again.settings_panel.serve
    assert serve.is_on and serve.port.value() == 0 and serve.key.text() == key and not serve.url.isVisible()
    app_driver.load(again)
    assert serve.url.isVisible() and serve.url.text().startswith("http://127.0.0.1:")
    (model,) = openai_client(serve.url.text(), key).models.list().data
    assert model.id == tiny_model_dir.name
