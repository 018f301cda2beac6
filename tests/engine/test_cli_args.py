"""What the `stowage` command says about its arguments: --version, refusals in the user's words, help texts."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from stowage.engine.cli import build_parser, main


def test_version():
    out = subprocess.run([sys.executable, "-P", "-c", "import stowage_entry; stowage_entry.main()", "--version"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("stowage ") and out.stdout.split()[1][0].isdigit()


@pytest.mark.parametrize("context", ["0", "-5"])
def test_plan_refuses_a_context_below_one_as_chat_does(tmp_path, capsys, context):
    assert main(["plan", str(tmp_path), "--context", context]) == 2
    err = capsys.readouterr().err
    assert f"--context must be at least 1, got {context}" in err
    assert "PlanRequest" not in err and "context_tokens" not in err


@pytest.mark.parametrize("option", ["--block-size", "--prefill-chunk", "--parallel"])
def test_plan_names_the_option_not_the_field(tmp_path, capsys, option):
    assert main(["plan", str(tmp_path), "--context", "64", option, "0"]) == 2
    err = capsys.readouterr().err
    assert f"{option} must be at least 1, got 0" in err and "PlanRequest" not in err


def test_chat_remote_without_a_scheme_is_taken_as_the_app_takes_it(capsys):
    assert main(["chat", "--remote", "not-a-url"]) == 2
    err = capsys.readouterr().err
    assert "http://" in err and "cannot reach http://not-a-url" in err
    assert "neither http:// nor https://" not in err


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", ["generate", "chat", "plan", "serve"])
def test_help_says_model_is_a_folder_or_a_gguf_file(command):
    text = _subparsers(build_parser())[command].format_help()
    assert "MODEL_DIR" not in text
    assert "MODEL" in text and ".gguf" in text


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_every_generate_and_chat_option_has_help(command):
    parser = _subparsers(build_parser())[command]
    missing = [a.option_strings or a.dest for a in parser._actions if not a.help]
    assert missing == []


def test_list_shows_the_demo_model_and_what_the_app_opened(tmp_path, monkeypatch, capsys):
    import json

    from factory import make_model
    from gguf_factory import write_gguf
    from stowage.engine.formats.discovery import remember_app_opened

    folder = make_model(tmp_path / "a folder, with a comma", "llama")
    gguf = write_gguf(folder, tmp_path / "Opened-Q8_0.gguf", "q8_0")
    data = tmp_path / "data"
    # as the app shares them (tests/app/test_opened_models_listed.py drives the app itself)
    remember_app_opened([str(folder), str(gguf), str(tmp_path / "gone")], {"STOWAGE_DATA_DIR": str(data)})
    for name, value in {"STOWAGE_DATA_DIR": data, "HOME": tmp_path, "HF_HUB_CACHE": tmp_path / "hf",
                        "OLLAMA_MODELS": tmp_path / "ollama"}.items():
        monkeypatch.setenv(name, str(value))
    assert main(["list", "--json"]) == 0
    models = json.loads(capsys.readouterr().out)["models"]
    assert [(m["name"], m["source"]) for m in models] == [
        ("demo-model", "demo"), ("a folder, with a comma", "app"), ("Opened-Q8_0", "app")]
    assert models[1]["path"] == str(folder) and models[2]["quant"] == "Q8_0"
