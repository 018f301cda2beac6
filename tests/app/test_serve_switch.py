"""The Serve switch: another program (the official openai client) reaches the app's engine at the shown URL with the
shown key, and is refused without it."""

import httpx
import openai
import pytest

TIMEOUT_S = 60


def client(url, key):
    # trust_env=False: a proxy from the environment must not stand between the test and 127.0.0.1
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=TIMEOUT_S,
                         http_client=httpx.Client(trust_env=False))


def test_serve_shows_the_engines_url_and_key_and_off_changes_the_key(app_driver, qtbot, tiny_model_dir):
    window = app_driver.open(tiny_model_dir)
    serve = window.settings_panel.serve
    assert not serve.url.isVisible() and "Load a model" in serve.note.text()
    app_driver.load(window)
    assert not serve.url.isVisible()  # off: the key stays private
    serve.switch.click()
    assert serve.url.isVisible() and serve.key.isVisible()
    url, key = serve.url.text(), serve.key.text()
    assert url.startswith("http://127.0.0.1:") and url.endswith("/v1") and len(key) >= 32
    assert f'"{tiny_model_dir.name}"' in serve.note.text()

    reply = client(url, key).chat.completions.create(
        model=tiny_model_dir.name, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0)
    assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):  # 401
        client(url, "not-the-key").models.list()
    with httpx.Client(trust_env=False) as plain:  # no key at all
        assert plain.get(url + "/models").status_code == 401
    # the app's own chat still works beside the other program
    window.settings_panel.max_tokens.setValue(3)
    assert app_driver.reply(window, lambda: app_driver.send(window, "Hi")).text

    # Serve off: the engine restarts with a new key, so the one given out stops working
    old_pid = window.client.worker.process.pid
    serve.switch.click()
    assert not serve.url.isVisible()
    qtbot.waitUntil(lambda: window.loaded_dir is not None and window.client.worker.process is not None
                    and window.client.worker.process.pid != old_pid, timeout=TIMEOUT_S * 1000)
    new_url, new_key, _ = window.client.worker.endpoint
    assert new_key != key
    with pytest.raises(openai.AuthenticationError):
        client(new_url, key).models.list()
    assert window.qsettings.value("serve") in (False, "false")


def test_the_switch_is_remembered_and_shows_the_next_engine_at_once(app_driver, qtbot, tiny_model_dir):
    window = app_driver.open(tiny_model_dir)
    window.settings_panel.serve.switch.click()  # on before anything is loaded
    window.close()
    again = app_driver.open(tiny_model_dir)
    serve = again.settings_panel.serve
    assert serve.is_on and not serve.url.isVisible()
    app_driver.load(again)
    assert serve.url.isVisible()
    (model,) = client(serve.url.text(), serve.key.text()).models.list().data
    assert model.id == tiny_model_dir.name
