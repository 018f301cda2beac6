import json
import time

from stowage.app.export import to_json, to_markdown
from stowage.app.store import Message

AT = time.mktime((2026, 3, 14, 15, 9, 0, 0, 0, -1))
SAMPLING = {"temperature": 0.3, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
            "max_tokens": 512, "seed": 7}
MESSAGES = [Message(1, "user", "What is 2+2?", created=AT),
            Message(2, "assistant", "```\n4\n```", {"tokens_per_s": 3.0, "model": "demo-model", "sampling": SAMPLING},
                    created=AT + 2)]


def test_markdown():
    text = to_markdown("Sums", MESSAGES)
    assert text.startswith("# Sums\n")
    assert "## You\n\n*2026-03-14 15:09*\n\nWhat is 2+2?" in text
    assert "## Assistant\n\n*demo-model · 2026-03-14 15:09 · temperature 0.3, top-p 0.95, top-k 40, min-p 0.05, " \
           "repetition penalty 1.1, seed 7*\n\n```\n4\n```" in text


def test_json_roundtrips():
    data = json.loads(to_json("Sums", MESSAGES))
    assert data["title"] == "Sums"
    assert data["messages"][0] == {"role": "user", "content": "What is 2+2?", "created": "2026-03-14T15:09:00"}
    assert data["messages"][1]["meta"]["sampling"] == SAMPLING and data["messages"][1]["meta"]["model"] == "demo-model"


def test_messages_without_dates_or_meta_export_as_before():
    text = to_markdown("Old", [Message(1, "user", "hi")])
    assert text == "# Old\n\n## You\n\nhi\n"


def test_a_message_with_other_versions_says_which_one_is_written():
    regenerated = Message(5, "assistant", "4", {"model": "demo-model"}, AT, parent_id=1, siblings=(2, 5))
    assert "*demo-model · 2026-03-14 15:09 · version 2 of 2*" in to_markdown("Sums", [MESSAGES[0], regenerated])
    entry = json.loads(to_json("Sums", [regenerated]))["messages"][0]
    assert (entry["version"], entry["num_versions"]) == (2, 2)
