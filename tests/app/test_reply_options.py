"""A chat's reply options in a real offscreen window: tools from a file whose calls (from the local engine's child and
from a remote `stowage serve`) are shown readably, kept in the store, answered with a tool result and exported; JSON
replies under a schema file that parse and validate; a file that does not hold up is a dialog, and the app goes on."""

import json

import jsonschema
import pytest

from stowage.app import export, tool_messages
from stowage.app.reply_options import JSON_OBJECT, ReplyOptions
from stowage.app.store import Message

CITY = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city",
                                           "parameters": CITY}}]
ANSWER = {"type": "object", "additionalProperties": False, "required": ["answer", "sure"],
          "properties": {"answer": {"type": "string", "maxLength": 16}, "sure": {"type": "boolean"}}}


@pytest.fixture
def tools_model_dir(tmp_path, tiny_model_dir):
    """The tiny model with a template that writes the tools into the prompt, as tool-calling models' templates do."""
    import shutil

    from factory import TEMPLATE, save_tokenizer

    model_dir = tmp_path / "tiny-tools"
    shutil.copytree(tiny_model_dir, model_dir)
    save_tokenizer(model_dir, "{% if tools %}<|system|>\nTools: {{ tools | tojson }}<|end|>\n{% endif %}" + TEMPLATE)
    return model_dir


@pytest.fixture
def files(tmp_path):
    paths = {"tools": tmp_path / "weather-tools.json", "schema": tmp_path / "answer.json",
             "unsatisfiable": tmp_path / "unsatisfiable.json", "not json": tmp_path / "broken.json",
             "deep": tmp_path / "deep.json"}
    # a call every time (required): a random model would seldom start one of its own accord
    paths["tools"].write_text(json.dumps({"tools": TOOLS, "tool_choice": "required"}))
    paths["schema"].write_text(json.dumps(ANSWER))
    paths["unsatisfiable"].write_text(json.dumps({"type": "object", "required": ["n"], "properties": {
        "n": {"type": "integer", "minimum": 5, "maximum": 1}}}))
    paths["not json"].write_text('{"type": "object",')
    paths["deep"].write_text("[" * 100_000 + "]" * 100_000)
    return paths


def _ask(app_driver, window, text):
    return app_driver.reply(window, lambda: app_driver.send(window, text))


def _call_and_answer(app_driver, qtbot, window, files):
    """Tools on, a question: the reply is a call shown readably and kept; its result sent back is answered."""
    chat = window.chat
    assert chat.reply_options.choose_tools(str(files["tools"]))
    assert chat.reply_options.text() == "Reply: 1 tool (weather-tools.json)"
    counted = []  # the prompt as the app counts it for the context policy
    window.client.worker.reply_started.connect(lambda started: counted.append(started.prompt_tokens))
    streamed = []  # the call as it arrives, piece by piece
    window.client.worker.tool_calls.connect(lambda cid, calls: streamed.append(calls[0]["function"]["arguments"]))
    reply = _ask(app_driver, window, "What is the weather in Paris?")
    app_counted = counted[-1]
    assert reply.result.finish_reason == "tool_calls"
    (call,) = reply.result.tool_calls
    assert call["function"]["name"] == "get_weather" and call["id"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)  # the grammar's doing, not the model's
    assert len(streamed) > 3 and streamed[-1] == call["function"]["arguments"]
    assert all(later.startswith(earlier) for earlier, later in zip(streamed, streamed[1:]))  # it grew
    cid = chat.conversation_id
    stored = window.store.messages(cid)[-1]
    assert stored.role == "assistant" and stored.meta["tool_calls"] == [call]
    shown = chat.view.widgets[-1].body.markdown
    assert "**Calls `get_weather`**" in shown and "```json\n{\n  \"city\"" in shown  # the arguments indented
    assert "The result of get_weather" in chat.input.placeholderText()
    if window.loaded_dir is not None:  # the model is here: the app's count is the engine's, the tools' tokens too
        assert app_counted == reply.result.prompt_tokens

    # the user runs the tool and types its result: kept as the call's answer, and the model goes on
    after = _ask(app_driver, window, '{"temperature": 21, "sky": "clear"}')
    messages = window.store.messages(cid)
    result = messages[-2]
    assert (result.role, result.meta) == ("tool", {"tool_call_id": call["id"], "name": "get_weather"})
    assert "**Result of `get_weather`**" in chat.view.widgets[-2].body.markdown
    assert messages[-1].role == "assistant" and after.result.prompt_tokens > reply.result.prompt_tokens
    written = json.loads(export.to_json("t", messages))["messages"]
    assert written[1]["tool_calls"] == [call] and written[2]["tool_call_id"] == call["id"]
    assert "**Result of `get_weather`**" in export.to_markdown("t", messages)
    return cid


def _json_reply(app_driver, window, files):
    chat = window.chat
    chat.reply_options.no_tools_action.trigger()
    assert chat.reply_options.choose_schema(str(files["schema"]))
    reply = _ask(app_driver, window, "Answer as JSON.")
    assert reply.result.finish_reason == "stop"
    jsonschema.validate(json.loads(reply.result.text), ANSWER)
    options = ReplyOptions.from_dict(window.store.conversation(chat.conversation_id).reply_options)
    assert options.response_format["json_schema"]["schema"] == ANSWER and not options.tools


def test_tool_calls_and_json_replies_from_the_local_engine(app_driver, qtbot, tools_model_dir, files):
    window = app_driver.open(tools_model_dir)
    app_driver.load(window)
    window.settings_panel.max_tokens.setValue(96)
    cid = _call_and_answer(app_driver, qtbot, window, files)
    _json_reply(app_driver, window, files)
    # the chat keeps its options: shown again with it
    window.chat.show_conversation(None)
    assert window.chat.reply_options.text() == "Reply: text"
    window.chat.show_conversation(cid)
    assert window.chat.reply_options.text() == "Reply: JSON (answer.json)"


def test_a_servers_tool_calls_and_json_replies(app_driver, qtbot, tiny_model_dir, server, files):
    window = app_driver.open(tiny_model_dir)
    app_driver.connect(window, server[1])
    panel = window.settings_panel
    panel.temperature.setValue(0.0)
    panel.max_tokens.setValue(96)
    _call_and_answer(app_driver, qtbot, window, files)
    chat = window.chat
    chat.reply_options.no_tools_action.trigger()
    chat.reply_options.json_action.trigger()
    assert chat.reply_options.options.response_format == JSON_OBJECT
    reply = _ask(app_driver, window, "Any JSON object.")
    assert isinstance(json.loads(reply.result.text), dict)


@pytest.mark.parametrize("name, says", [("unsatisfiable", "unsatisfiable"), ("not json", "is not JSON"),
                                        ("deep", "nested too deeply")])  # deep: a RecursionError in a slot before
def test_a_schema_that_does_not_hold_up_is_a_dialog_and_nothing_changes(app_driver, qtbot, tiny_model_dir, files,
                                                                        name, says):
    window = app_driver.open(tiny_model_dir)
    button = window.chat.reply_options
    assert not button.choose_schema(str(files[name]))
    assert button.error_box.isVisible() and says in button.error_box.text()
    assert button.options == ReplyOptions() and window.store.conversations() == []  # no chat made for it
    assert not button.choose_tools(str(files["schema"]))  # a schema is not a list of tools
    assert "holds no tools" in button.error_box.text()
    button.error_box.accept()
    assert button.choose_schema(str(files["schema"])) and window.isVisible()  # the app goes on


def test_tool_messages_read_and_answer():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": [1, 2]}'}}
    reply = Message(2, "assistant", "", {"tool_calls": [call, {**call, "id": "call_2"}]})
    result = Message(3, "tool", "not json", {"tool_call_id": "call_1", "name": "f"})
    assert tool_messages.markdown(reply).count("**Calls `f`**") == 2 and '"a": [\n    1,' in tool_messages.markdown(reply)
    assert tool_messages.markdown(result) == "**Result of `f`**\n\n```\nnot json\n```"
    assert tool_messages.api_message(reply) == {"role": "assistant", "content": "", "tool_calls": [call, {
        **call, "id": "call_2"}]}
    assert tool_messages.api_message(result) == {"role": "tool", "content": "not json", "tool_call_id": "call_1"}
    user = Message(1, "user", "hi")
    assert tool_messages.pending_call([user, reply])["id"] == "call_1"
    assert tool_messages.pending_call([user, reply, result])["id"] == "call_2"
    assert tool_messages.pending_call([user, reply, result, Message(4, "tool", "x", {"tool_call_id": "call_2"})]) \
        is None
    assert tool_messages.pending_call([user]) is None


def test_json_replies_with_the_engine_in_the_apps_process(app_driver, qtbot, tiny_model_dir, files, monkeypatch):
    """STOWAGE_ENGINE_PROCESS=0: the grammar is bound in the worker, as the engine's server binds it; tools, which
    need the server, are a message in the chat and the chat goes on."""
    from stowage.app import worker

    monkeypatch.setattr(worker, "ENGINE_PROCESS", False)
    window = app_driver.open(tiny_model_dir)
    app_driver.load(window)
    assert window.client.worker.engine is not None  # in this process
    window.settings_panel.max_tokens.setValue(96)
    chat = window.chat
    assert chat.reply_options.choose_schema(str(files["schema"]))
    reply = _ask(app_driver, window, "Answer as JSON.")
    jsonschema.validate(json.loads(reply.result.text), ANSWER)
    assert chat.reply_options.choose_tools(str(files["tools"]))
    failed = []
    window.client.worker.reply_failed.connect(lambda cid, message: failed.append(message))
    app_driver.send(window, "And the weather?")
    qtbot.waitUntil(lambda: bool(failed), timeout=app_driver.timeout_ms)  # (this lambda runs in the engine's thread)
    qtbot.waitUntil(chat.error.isVisible, timeout=app_driver.timeout_ms)
    assert "tools need the engine in its own process" in failed[0] == chat.error.text()
    assert chat.send_button.isEnabled()
