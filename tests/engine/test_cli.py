"""The `stowage` command as a user runs it, in a subprocess."""

import json
import subprocess
import sys

import pytest
from factory import make_model

from stowage.engine.runtime.engine import Engine
from factory import cpu_plan
from stowage.engine.runtime.sampler import SamplingParams


def stowage(*args):
    return subprocess.run([sys.executable, "-P", "-m", "stowage.engine.cli", *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("cli"), "qwen2", initializer_range=0.2)


def test_generate_json_matches_the_engine(model_dir):
    out = stowage("generate", model_dir, "--prompt", "Stowage plans memory", "--max-tokens", 12, "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    engine = Engine.load(model_dir, cpu_plan(model_dir, 64))
    ids = engine.tokenizer.encode("Stowage plans memory")
    expected = engine.generate(ids, SamplingParams(temperature=0, max_tokens=12)).run()
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
    out = subprocess.run([sys.executable, "-P", "-m", "stowage.engine.cli", "chat", str(model_dir), "--max-tokens", "4",
                          "--temperature", "0"], input="Hello\nAgain\n", capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    reports = [line for line in out.stderr.splitlines() if "tokens reused" in line]
    assert len(reports) == 2
    assert reports[0].startswith("[0 tokens reused") and not reports[1].startswith("[0 tokens reused")


# -- issue 12: arguments checked before loading; a full conversation keeps the session ---------------------------

@pytest.mark.parametrize("args,message", [
    (["generate", "--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate", "--prompt", "x", "--top-p", "2"], r"top_p must be in \(0, 1\]"),
    (["generate", "--prompt", "x", "--max-tokens", "0"], "max_tokens must be >= 1"),
    (["generate", "--prompt", "x", "--temperature", "nan"], "temperature must be a finite number"),
    (["generate", "--prompt", "x", "--repetition-penalty", "nan"], "repetition_penalty must be a finite number"),
    (["generate", "--prompt", "x", "--min-p", "inf"], "min_p must be a finite number"),
    (["chat", "--context", "0"], "--context must be at least 1 token, got 0"),
    (["chat", "--top-k", "-3"], "top_k must be >= 0"),
])
def test_bad_arguments_are_refused_before_the_model_is_read(tmp_path, capsys, args, message):
    from stowage.engine.cli import main
    # tmp_path holds no model: had anything been read first, the error would be about config.json
    code = main([args[0], str(tmp_path), *args[1:]])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stowage: ")
    assert __import__("re").search(message, lines[0]) and "config.json" not in err


def test_a_prompt_that_is_not_utf8_is_a_clean_error(tmp_path):
    # bytes that are not UTF-8 reach Python as lone surrogates (argv is decoded with surrogateescape)
    out = subprocess.run([sys.executable, "-P", "-m", "stowage.engine.cli", "generate", str(tmp_path), "--prompt", b"caf\xe9"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "stowage: --prompt is not valid UTF-8" in out.stderr and "Traceback" not in out.stderr


def chat(model_dir, stdin: bytes, *args):
    out = subprocess.run([sys.executable, "-P", "-m", "stowage.engine.cli", "chat", str(model_dir), "--max-tokens", "6",
                          "--temperature", "0", *map(str, args)], input=stdin, capture_output=True, timeout=300)
    return out.returncode, out.stderr.decode("utf-8", "replace")


def test_a_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(model_dir):
    code, err = chat(model_dir, b"caf\xe9\nHello\n")
    assert code == 0, err
    assert "is not valid UTF-8" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if "tokens reused" in line]) == 1  # "Hello" was answered


def test_chat_starts_a_new_conversation_when_the_context_is_full(model_dir):
    lines = [f"Tell me about the quick brown fox and the lazy dog, part {i}." for i in range(5)]
    code, err = chat(model_dir, "".join(line + "\n" for line in lines).encode(), "--context", 48)
    assert code == 0, err
    assert "the conversation is full" in err and "starting a new conversation" in err
    assert len([line for line in err.splitlines() if "tokens reused" in line]) == len(lines)  # every line answered


def test_chat_says_when_one_message_alone_does_not_fit(model_dir):
    long_line = " ".join(["Stowage plans memory"] * 40)
    code, err = chat(model_dir, f"{long_line}\nHi\n".encode(), "--context", 48)
    assert code == 0, err
    assert "that message alone does not fit" in err
    assert len([line for line in err.splitlines() if "tokens reused" in line]) == 1  # "Hi" was answered


# -- issue 16: the thread count; issue 10: stowage list ---------------------------------------------------------

@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_threads_is_an_option_of_each_engine_command_and_checked(tmp_path, capsys, command):
    from stowage.engine.cli import build_parser, main

    extra = ["--prompt", "x"] if command == "generate" else []
    assert build_parser().parse_args([command, str(tmp_path), *extra, "--threads", "3"]).threads == 3
    assert main([command, str(tmp_path), *extra, "--threads", "0"]) == 2
    assert capsys.readouterr().err.strip() == "stowage: --threads must be at least 1, got 0"


def test_stowage_list_is_registered(tmp_path):
    env = {**__import__("os").environ, "HOME": str(tmp_path), "OLLAMA_MODELS": str(tmp_path / "none")}
    out = subprocess.run([sys.executable, "-P", "-m", "stowage.engine.cli", "list", "--json", "--models-dir", str(tmp_path)],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert isinstance(__import__("json").loads(out.stdout), (list, dict))
