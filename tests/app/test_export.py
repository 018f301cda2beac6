import json

from app.export import to_json, to_markdown
from app.store import Message

MESSAGES = [Message(1, "user", "What is 2+2?"), Message(2, "assistant", "```\n4\n```", {"tokens_per_s": 3.0})]


def test_markdown():
    text = to_markdown("Sums", MESSAGES)
    assert text.startswith("# Sums\n")
    assert "## You\n\nWhat is 2+2?" in text
    assert "## Assistant\n\n```\n4\n```" in text


def test_json_roundtrips():
    data = json.loads(to_json("Sums", MESSAGES))
    assert data["title"] == "Sums"
    assert data["messages"][0] == {"role": "user", "content": "What is 2+2?"}
    assert data["messages"][1]["meta"] == {"tokens_per_s": 3.0}
