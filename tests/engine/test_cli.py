"""The `stowage` command as a user runs it, in a subprocess."""

import json
import subprocess
import sys

import pytest
from factory import make_model

from engine.engine import Engine
from factory import cpu_plan
from engine.sampler import SamplingParams


def stowage(*args):
    return subprocess.run([sys.executable, "-m", "engine.cli", *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("cli"), "qwen2", initializer_range=0.2)


def test_generate_json_matches_the_engine(model_dir):
    out = stowage("generate", model_dir, "--prompt", "Stowage plans memory", "--max-tokens", 12, "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    engine = Engine.load(model_dir, cpu_plan(model_dir, 64))
    ids = engine.tokenizer.encode("Stowage plans memory")
    expected = engine.generate(engine.new_conversation(), ids, SamplingParams(temperature=0, max_tokens=12)).run()
    assert result["token_ids"] == expected.token_ids
    assert result["text"] == expected.text
    assert result["prompt_tokens"] == len(ids)
    assert result["decode_tokens_per_s"] > 0 and result["prefill_tokens_per_s"] > 0
    assert "layer 3/3" in out.stderr  # progress is shown on stderr while loading


def test_generate_prints_only_text_and_chat_uses_the_template(model_dir):
    plain = stowage("generate", model_dir, "--prompt", "Hi", "--max-tokens", 5, "--json")
    chat = stowage("generate", model_dir, "--prompt", "Hi", "--max-tokens", 5, "--json", "--chat")
    assert json.loads(chat.stdout)["prompt_tokens"] > json.loads(plain.stdout)["prompt_tokens"]
    text = stowage("generate", model_dir, "--prompt", "Hi", "--max-tokens", 5)
    assert text.stdout == json.loads(plain.stdout)["text"] + "\n"


def test_errors_are_one_readable_line(tmp_path):
    out = stowage("generate", tmp_path, "--prompt", "x")
    assert out.returncode == 2
    assert "stowage: " in out.stderr and "config.json" in out.stderr and "Traceback" not in out.stderr


def test_terminal_chat_keeps_history(model_dir):
    out = subprocess.run([sys.executable, "-m", "engine.cli", "chat", str(model_dir), "--max-tokens", "4",
                          "--temperature", "0"], input="Hello\nAgain\n", capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    reports = [line for line in out.stderr.splitlines() if "tokens reused" in line]
    assert len(reports) == 2
    assert reports[0].startswith("[0 tokens reused") and not reports[1].startswith("[0 tokens reused")
