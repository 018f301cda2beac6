"""Open the app and drive it into a state of issue 29's and 28's app parts for a screenshot, under Xvfb
(../shared/tools/screenshot). Usage: STOWAGE_DATA_DIR=$(mktemp -d) python docs/screenshots/drive_replies.py STATE

States: tools (a chat with tools from a file: a call shown with its arguments, the result typed for it and the reply,
then a second call waiting for its result), json (the demo model loaded and a reply held to a JSON schema file),
moe (a Qwen3-30B-A3B-shaped GGUF whose data is a hole: its experts in the model's line and in the plan bar).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from shots import open_window, planned, when

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 24}, "days": {"type": "integer", "minimum": 1,
                                                                              "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city",
                                           "parameters": WEATHER}}]
MODEL_PICK = {"type": "object", "additionalProperties": False, "required": ["model", "context_tokens", "fits"],
              "properties": {"model": {"type": "string", "maxLength": 24},
                             "context_tokens": {"type": "integer", "minimum": 512, "maximum": 32768},
                             "fits": {"type": "boolean"}}}


def call(id_, city, days):
    return {"id": id_, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "days": days})}}


def tools(window, folder):
    path = folder / "weather-tools.json"
    path.write_text(json.dumps(TOOLS, indent=2))
    store = window.store
    cid = store.create("Weekend weather")
    store.add_message(cid, "user", "Will it rain in Lisbon this weekend?")
    store.add_message(cid, "assistant", "", {"finish_reason": "tool_calls", "tool_calls": [call("call_7f3a", "Lisbon",
                                                                                                2)]})
    store.add_message(cid, "tool", '{"saturday": {"rain_mm": 0, "high_c": 24}, "sunday": {"rain_mm": 3.5, '
                                   '"high_c": 19}}', {"tool_call_id": "call_7f3a", "name": "get_weather"})
    store.add_message(cid, "assistant", "Saturday stays dry at 24 °C; Sunday brings about 3.5 mm of rain.",
                      {"finish_reason": "stop", "tokens_per_s": 28.4})
    store.add_message(cid, "user", "And in Porto?")
    store.add_message(cid, "assistant", "", {"finish_reason": "tool_calls", "tool_calls": [call("call_91bc", "Porto",
                                                                                                2)]})
    window.conversations.refresh()
    window.conversations.select(cid)
    window.chat.reply_options.choose_tools(str(path))


def json_reply(window, folder):
    path = folder / "model-pick.json"
    path.write_text(json.dumps(MODEL_PICK, indent=2))
    panel = window.settings_panel
    panel.context.spin.setValue(2048)
    panel.temperature.setValue(0.0)
    window.load()

    def ask():
        window.chat.reply_options.choose_schema(str(path))
        window.chat.input.setPlainText("Which model would you pick for a 16 GB laptop, and what context?")
        window.chat.send()

    when(lambda: window.loaded_dir is not None, ask)


def moe(window, folder):
    from moe_factory import QWEN3_30B_A3B, write_sparse_moe_gguf

    path = folder / "Qwen3-30B-A3B-Q4_K_M.gguf"
    write_sparse_moe_gguf(path, QWEN3_30B_A3B)
    window.settings_panel.picker.open_path(str(path))
    when(lambda: window.forecast is not None and window.forecast.info.model_dir == path,
         lambda: window.settings_panel.context.spin.setValue(16384))


def main() -> int:
    state = sys.argv[1]
    app, window = open_window()
    folder = Path(tempfile.mkdtemp(prefix="stowage-shot-"))
    when(planned(window), lambda: {"tools": tools, "json": json_reply, "moe": moe}[state](window, folder))
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
