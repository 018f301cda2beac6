"""`stowage search`, `stowage pull` and `stowage plan REPO[:FILE]` against tests/support/hub_server.py (HF_ENDPOINT)."""

from __future__ import annotations

import json

import pytest
from factory import make_model
from gguf_factory import write_gguf
from hub_server import HubServer, Repo

from stowage.engine.cli import main
from stowage.engine.hub import header

PLAN_BUDGETS = ("--gpu-budget", "0", "--ram-budget", "8GiB")  # the same machine for the remote and the local plan


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-cli")
    st = make_model(root / "st", "qwen2")
    return {"q8": write_gguf(st, root / "Tiny-Q8_0.gguf", "q8_0"), "f16": write_gguf(st, root / "Tiny-F16.gguf", "f16")}


@pytest.fixture
def hub(files, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("STOWAGE_DATA_DIR", str(tmp_path / "data"))  # headers read are kept there
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(header, "FIRST_READ_BYTES", 16 << 10)
    with HubServer() as server:
        server.add(Repo("acme/Tiny-GGUF", {"Tiny-Q8_0.gguf": files["q8"], "Tiny-F16.gguf": files["f16"]},
                        tags=("gguf", "qwen2"), gguf_architecture="qwen2", downloads=9))
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


def test_search_prints_a_table(hub, capsys):
    assert main(["search", "tiny"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["REPO", "FORMAT", "ARCH", "DOWNLOADS", "LIKES"]
    assert out[1].split() == ["acme/Tiny-GGUF", "gguf", "qwen2", "9", "0"]


def test_pull_by_quant_then_plan_it_locally_and_remotely_alike(hub, capsys, files):
    assert main(["pull", "acme/Tiny-GGUF", "--quant", "q8_0"]) == 0
    captured = capsys.readouterr()
    path = captured.out.strip()
    assert open(path, "rb").read() == files["q8"].read_bytes()
    assert "100%" in captured.err and "Ready: stowage chat" in captured.err  # the terminal's progress bar
    assert "Tiny-Q8_0.gguf (Q8_0, 218.0 KiB): on this machine, fits" in captured.err  # said before downloading
    assert main(["plan", path, "--context", "512", "--json", *PLAN_BUDGETS]) == 0
    local = json.loads(capsys.readouterr().out)
    gets_before = len(hub.requests)
    assert main(["plan", "acme/Tiny-GGUF:Tiny-Q8_0.gguf", "--context", "512", "--json", *PLAN_BUDGETS]) == 0
    remote = json.loads(capsys.readouterr().out)
    local.pop("kv_disk_free_bytes"), remote.pop("kv_disk_free_bytes")  # the disk's free space, read live by each
    assert remote == local
    assert all(r is not None for m, p, r, _ in hub.requests[gets_before:] if p.startswith("/cdn-lfs/"))  # ranges only


def test_plan_of_a_repository_gives_a_verdict_per_file(hub, capsys):
    assert main(["plan", "acme/Tiny-GGUF", "--context", "512", *PLAN_BUDGETS]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["Tiny-Q8_0.gguf", "Tiny-F16.gguf"]
    assert all("fits in RAM (no layer fits on the GPU) at 512 tokens" in line for line in lines), lines
    assert main(["plan", "acme/Tiny-GGUF", "--context", "512", "--ram-budget", "40MiB", "--gpu-budget", "0"]) == 1
    assert "does not fit" in capsys.readouterr().out


def test_pull_without_a_choice_lists_the_choices(hub, capsys):
    assert main(["pull", "acme/Tiny-GGUF"]) == 2
    err = capsys.readouterr().err
    assert "holds 2 models; choose one with --file or --quant: Tiny-Q8_0.gguf (Q8_0), Tiny-F16.gguf (F16)" in err
    assert "Traceback" not in err


def test_missing_repository_is_one_line(hub, capsys):
    assert main(["pull", "acme/Nothing"]) == 2
    assert "no repository 'acme/Nothing'" in capsys.readouterr().err
    assert main(["plan", "acme/Nothing:x.gguf", "--context", "64"]) == 2
    err = capsys.readouterr().err
    assert "acme/Nothing:x.gguf is no file or folder here; as a Hugging Face repository: no repository" in err


def test_planning_a_repository_with_nothing_runnable_says_so(hub, capsys):
    # before: "max() arg is an empty sequence" with --context, "holds 0 models: give --context N" without
    hub.add(Repo("acme/Notes", {"README.md": b"# notes\n", "notes.txt": b"no weights"}, tags=("text",)))
    for extra in ((), ("--context", "512")):
        assert main(["plan", "acme/Notes", *extra, *PLAN_BUDGETS]) == 2
        assert capsys.readouterr().err.strip().endswith("acme/Notes holds no model Stowage can run (GGUF files, "
                                                         "or safetensors with a config.json)")


def test_ctrl_c_in_a_hub_command_is_a_line_not_a_traceback(hub, capsys, monkeypatch):
    # before: a KeyboardInterrupt during a search or a header read ended in a traceback
    from stowage.engine.hub.client import Hub

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Hub, "search", interrupted)  # Ctrl-C while the search waits on the network
    assert main(["search", "tiny"]) == 130
    assert capsys.readouterr().err.strip() == "stowage: interrupted"


def test_pull_resumes_a_dropped_download_and_refuses_a_corrupt_one(hub, capsys, files, tmp_path):
    hub.drop_after["Tiny-Q8_0.gguf"] = 60_000
    assert main(["pull", "acme/Tiny-GGUF", "--quant", "q8_0"]) == 0
    path = capsys.readouterr().out.strip()
    assert open(path, "rb").read() == files["q8"].read_bytes()  # checked against the listed SHA-256
    gets = [r for method, p, r, _ in hub.requests if method == "GET" and p.startswith("/cdn-lfs/") and r != "bytes=0-"]
    assert "bytes=60000-" in gets  # the rest asked for after the drop
    hub.corrupt.add("Tiny-F16.gguf")
    assert main(["pull", "acme/Tiny-GGUF", "--quant", "f16"]) == 2
    err = capsys.readouterr().err
    assert "corrupted on the way and has been discarded" in err and "Traceback" not in err
    assert not list((tmp_path / "hf-cache").glob("**/Tiny-F16.gguf"))  # never listed as a model
