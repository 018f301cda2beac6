"""`stowage plan`: the table, the JSON, and the exit status, as a user runs them."""

import json
import subprocess
import sys

import pytest

from stowage.engine.cli import main
from sparse_models import LLAMA_3_1_8B, write_sparse_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_sparse_model(tmp_path_factory.mktemp("llama8b"), LLAMA_3_1_8B, num_shards=4)


def plan_json(capsys, *args) -> tuple[int, dict]:
    status = main(["plan", *map(str, args), "--json"])
    return status, json.loads(capsys.readouterr().out)


def test_table_from_the_console_command(model_dir):
    out = subprocess.run(
        [sys.executable, "-P", "-m", "stowage.engine.cli", "plan", str(model_dir), "--context", "32768", "--kv-dtype", "fp16",
         "--gpu-budget", "8GiB", "--ram-budget", "16GiB"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].endswith("32 layers, bfloat16 compute, float16 KV cache, 32,768 tokens (block 16, prefill chunk 512)")
    assert lines[1].split()[:3] == ["device", "layers", "weights"]
    assert lines[2].split()[:3] == ["cuda:0", "(GPU)", "0-11"]
    assert lines[3].split()[:3] == ["cpu", "(RAM)", "12-31"]
    assert lines[-2].startswith("fits: 12/32 layers on GPU 0, 20/32 on CPU")
    assert lines[-1].startswith("CPU decode step: ")


def test_json_when_it_does_not_fit(model_dir, capsys):
    status, d = plan_json(capsys, model_dir, "--context", 131072, "--kv-dtype", "float16",
                          "--gpu-budget", "8GiB", "--ram-budget", "16GiB")
    assert status == 1
    assert d["fits"] is False and d["context_tokens"] == 131072 and d["kv_dtype"] == "float16"
    assert d["block_size"] == 16
    assert f"the largest context that fits is {d['max_context_tokens']:,} tokens" in d["error"]
    gpu, cpu = d["devices"]
    assert gpu["device"] == "cuda:0" and cpu["device"] == "cpu"
    assert gpu["reserve_bytes"] == 512 * 2**20 and gpu["budget_bytes"] == 8 * 2**30 - 512 * 2**20
    assert cpu["total_bytes"] > cpu["budget_bytes"]


def test_json_when_it_fits_with_two_gpus(model_dir, capsys):
    status, d = plan_json(capsys, model_dir, "--context", 32768, "--kv-dtype", "float16",
                          "--gpu-budget", "12GiB", "--gpu-budget", "8GiB", "--ram-budget", "16GiB")
    assert status == 0 and d["fits"] and d["error"] is None
    assert [dev["device"] for dev in d["devices"]] == ["cuda:0", "cuda:1", "cpu"]
    assert [len(dev["layers"]) for dev in d["devices"]] == [20, 11, 1]
    for dev in d["devices"]:
        assert dev["total_bytes"] == dev["weights_bytes"] + dev["kv_bytes"] + dev["workspace_bytes"]
        assert dev["total_bytes"] <= dev["budget_bytes"]


def test_cpu_only_and_decimal_sizes(model_dir, capsys):
    status, d = plan_json(capsys, model_dir, "--context", 8192, "--gpu-layers", 0, "--gpu-budget", "24GiB",
                          "--ram-budget", "40GB")
    assert status == 0
    assert d["layer_devices"] == ["cpu"] * 32
    assert d["devices"][1]["reserve_bytes"] == 2 * 10**9  # 5% of 40 GB
    assert d["devices"][1]["budget_bytes"] == 38 * 10**9


def test_without_context_plans_the_largest_that_fits(model_dir, capsys, monkeypatch):
    from stowage.kernels import cpu_decode

    args = ("--kv-dtype", "fp16", "--ram-budget", "32GiB", "--gpu-layers", 0)
    monkeypatch.setenv("STOWAGE_NATIVE_DECODE", "0")  # the reference's workspace, as test_planner.py works it out
    monkeypatch.setenv("STOWAGE_WIDEN_MATMUL", "0")  # for a CPU of fast 16-bit products, as test_planner.py does
    cpu_decode.selected_isa.cache_clear()
    try:
        status, d = plan_json(capsys, model_dir, *args)
        assert status == 0 and d["context_tokens"] == d["max_context_tokens"] == 116_432  # test_planner.py
    finally:
        monkeypatch.undo()
        cpu_decode.selected_isa.cache_clear()
    if cpu_decode.current() is not None:  # the native attention's scratch does not grow with the context
        status, d = plan_json(capsys, model_dir, *args)
        assert status == 0 and d["context_tokens"] == d["max_context_tokens"] > 116_432


def test_ram_limit_option(model_dir, capsys):
    status, d = plan_json(capsys, model_dir, "--context", 65536, "--ram-budget", "64GiB", "--ram-limit", "20GiB",
                          "--gpu-layers", "0")
    assert status == 1 and "capped by the 20.0 GiB RAM limit" in d["error"]


def test_detected_budgets_say_cpu_only_without_a_driver(model_dir, capsys):
    import pynvml

    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present")
    except pynvml.NVMLError:
        pass
    status, d = plan_json(capsys, model_dir, "--context", 1024)
    assert d["note"].startswith("CPU only: no NVIDIA driver found")
    assert [dev["device"] for dev in d["devices"]] == ["cpu"]


def test_bad_size_and_bad_model(tmp_path, model_dir, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", str(model_dir), "--ram-budget", "16 parsecs"])
    assert e.value.code == 2
    assert "for example 24GiB" in capsys.readouterr().err
    assert main(["plan", str(tmp_path), "--context", "1024"]) == 2
    assert "no config.json" in capsys.readouterr().err
    status, d = plan_json(capsys, tmp_path, "--context", 1024)
    assert status == 2 and d["fits"] is False and "no config.json" in d["error"]
