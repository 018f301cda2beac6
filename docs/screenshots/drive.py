"""Open the app and drive it into one state for a screenshot (run under Xvfb by ../shared/tools/screenshot).

Usage: STOWAGE_DATA_DIR=$(mktemp -d) python docs/screenshots/drive.py STATE
States: empty, reply, overflow, error, history (a corrupt history moved aside), about, small (1000x700,
a context typed that is not whole blocks), small-reply (1000x700 with replies), search (three chats, one found),
branches (a reply regenerated: "‹ 2/2 ›"), prompt (a long prompt being read, in the engine process, held at its
first chunk so the bar stays on screen), markdown (highlighted code with Copy, a table, a preset chosen), dark (the
same in the dark theme), full (a chat that outgrew its context, with its ways on), base (a base model loaded: its
notice and completion mode).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from PySide6.QtCore import Qt
from shots import open_window, when

from stowage.app import paths, theme, worker
from stowage.app.conversation_list import ID_ROLE
from stowage.app.paths import demo_model_dir
from stowage.app.store import FILE_NAME
from stowage.engine.planning.plan import PlanRequest, plan

QUESTIONS = ["What does Stowage do when I move the context slider?", "What if it does not fit?"]
ANSWER = """Here is a function that does it, and what it returns:

```python
def largest_context(free_bytes: int, bytes_per_token: int) -> int:
    \"\"\"The most tokens whose KV cache fits in free_bytes.\"\"\"
    return free_bytes // bytes_per_token  # whole tokens only
```

| Model | KV per token | Largest context |
|:------|-------------:|----------------:|
| SmolLM2-135M | 92 KiB | 44,000 |
| Qwen2.5-0.5B | 12 KiB | 350,000 |
"""


def main(state: str) -> None:
    if state == "history":
        (paths.data_dir() / FILE_NAME).write_bytes(b"this is not an SQLite database " * 100)
    if state == "prompt":
        worker.ENGINE_PROCESS = True  # the child streams the prefill's progress
    app, window = open_window((1000, 700) if state in ("small", "small-reply") else (1280, 800))
    panel = window.settings_panel
    planned = lambda: panel.plan is not None  # noqa: E731

    def load_and_ask():
        panel.context.spin.setValue(2048)
        panel.temperature.setValue(0.3)
        panel.seed.setValue(7)
        window.load()
        when(lambda: window.loaded_dir is not None, ask)

    pending = list(QUESTIONS)

    def ask(*_):
        if pending:
            window.chat.input.setPlainText(pending.pop(0))
            window.chat.send()

    if state in ("reply", "small-reply"):
        window.chat.reply_done.connect(ask)

    def regenerate_once():
        window.chat.reply_done.disconnect(regenerate_once)
        window.chat.regenerate()

    def branches():
        window.chat.reply_done.connect(regenerate_once)
        pending[1:] = []
        load_and_ask()

    def long_prompt():
        held = []

        def hold(_cid, done, total):  # in the engine thread: the reply waits while the screenshot is taken
            if done < total and not held:
                held.append(done)
                time.sleep(120)

        window.client.worker.prefill_progress.connect(hold, Qt.ConnectionType.DirectConnection)
        pending[:] = [("Summarize this report. " + " ".join(
            f"Section {i}: the context slider sets how many tokens the model keeps in mind; the bar shows "
            "the memory it takes." for i in range(40)))]
        load_and_ask()

    def overflow():
        # A RAM limit just above what 1,024 tokens need, then a context twice that: the bar runs over.
        cost = plan(window.forecast.info, PlanRequest(1024), window.forecast.detected).device("cpu").total_bytes
        panel.ram_limit.setValue(round(cost / 1024**3 + 0.005, 2))
        panel.context.spin.setValue(2048)

    def broken():
        folder = Path(tempfile.mkdtemp()) / "half-downloaded-model"
        shutil.copytree(demo_model_dir(), folder)
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
        window.chat.input.setPlainText("A message typed before the error stays here.")
        panel.select_model_dir(str(folder))
        window.choose_model(str(folder))

    def markdown():
        store = window.store
        cid = store.create("Largest context in Python")
        store.add_message(cid, "user", "Write a function for the **largest context** that fits, in Python.")
        store.add_message(cid, "assistant", ANSWER, {"finish_reason": "stop", "tokens_per_s": 31.2,
                                                    "first_token_s": 0.21, "prompt_tokens_per_s": 812})
        store.set_preset(cid, store.save_preset("Python tutor", "You teach Python with short, tested examples.",
                                                {"temperature": 0.2, "top_k": 20}))
        window.conversations.select(cid)

    def dark():
        theme.apply("dark")
        markdown()

    def full():
        panel.policy.setCurrentIndex(panel.policy.findData("stop"))
        panel.max_tokens.setValue(16)
        pending[:] = [" ".join(f"Note {i}: the context slider sets how many tokens the model keeps in mind."
                               for i in range(12))] * 4
        window.chat.reply_done.connect(ask)
        panel.context.spin.setValue(512)
        window.load()
        when(lambda: window.loaded_dir is not None, ask)

    def base():
        folder = Path(tempfile.mkdtemp()) / "demo-base-model"
        shutil.copytree(demo_model_dir(), folder)
        config = folder / "tokenizer_config.json"
        settings = json.loads(config.read_text())
        settings.pop("chat_template")  # as a base model's tokenizer comes: no template
        config.write_text(json.dumps(settings))
        panel.picker.add_folder(str(folder))
        panel.select_model_dir(str(folder))
        window.choose_model(str(folder))
        when(lambda: panel.plan is not None and window.model_dir == str(folder), window.load)

    def search():
        store = window.store
        for title, text in (("Trip to Lisbon", "Which trams go up to the castle?"),
                            ("Taxes 2026", "What counts as a home office?"),
                            ("Sourdough", "My starter smells of acetone after a week in the fridge.")):
            store.add_message(store.create(title), "user", text)
        window.conversations.refresh()
        window.conversations.find()
        window.conversations.search.setText("fridge")
        window.conversations.select(window.conversations.list.item(0).data(ID_ROLE))

    actions = {"empty": lambda: None, "search": search, "small-reply": load_and_ask, "reply": load_and_ask,
               "branches": branches, "prompt": long_prompt, "overflow": overflow, "error": broken,
               "markdown": markdown, "dark": dark, "full": full, "base": base,
               "history": lambda: None, "about": window.about_action.trigger,
               "small": lambda: panel.context.spin.setValue(1000)}
    when(planned, actions[state])
    app.exec()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "empty")
