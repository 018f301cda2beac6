"""The CLI's light commands start without the heavy libraries: `--help`, `--version` and `list` import neither
torch nor transformers nor Qt, and `generate` leaves torch to its engine child, which it starts before reading the
prompt and sends the plan request once the prompt is counted (a fresh interpreter, checked through sys.modules
after the command ran)."""

import json
import subprocess
import sys

import pytest
from factory import make_model
from gguf_factory import write_gguf

from stowage.engine.errors import EngineStartError
from stowage.engine.plan_request import PlanRequest
from stowage.engine.process.engine_process import EngineProcess
from stowage.engine.runtime.sampling_params import SamplingParams

HEAVY = ("torch", "transformers", "PySide6", "numpy", "tokenizers", "jinja2", "httpx")

# Runs the command as `stowage` does (stowage_entry.main), then prints the heavy modules it imported.
PROBE = """
import json, sys
import stowage_entry
try:
    status = stowage_entry.main(sys.argv[1:])
except SystemExit as e:  # argparse's --help and --version
    status = e.code
print(json.dumps({"status": status, "heavy": sorted({m.split(".")[0] for m in sys.modules} & set(%r))}))
""" % (HEAVY,)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("startup")
    return write_gguf(make_model(folder / "hf", "llama"), folder / "tiny-Q8_0.gguf", "q8_0")


def imported(*args: str, tmp_path) -> dict:
    env = {"HOME": str(tmp_path), "STOWAGE_DATA_DIR": str(tmp_path / "data"), "PATH": "/usr/bin:/bin",
           "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-P", "-c", PROBE, *args], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    *printed, last = out.stdout.strip().splitlines()
    return {**json.loads(last), "printed": "\n".join(printed)}


@pytest.mark.parametrize("args", [("--help",), ("--version",), ("generate", "--help"), ("plan", "--help")])
def test_help_and_version_import_nothing_heavy(tmp_path, args):
    result = imported(*args, tmp_path=tmp_path)
    assert (result["status"], result["heavy"]) == (0, [])
    assert "stowage" in result["printed"]


def test_list_imports_no_torch(tmp_path, tiny_gguf):
    """`list` reads GGUF headers (numpy) but never imports torch, even with a GGUF model in the models folder."""
    models = tmp_path / "models"
    models.mkdir()
    (models / tiny_gguf.name).symlink_to(tiny_gguf)
    result = imported("list", "--models-dir", str(models), tmp_path=tmp_path)
    assert result["status"] == 0
    assert "tiny-Q8_0" in result["printed"] and "Q8_0" in result["printed"]  # its header was read
    assert "torch" not in result["heavy"] and "transformers" not in result["heavy"] and "PySide6" not in result["heavy"]


def test_generate_leaves_torch_to_the_engine_child(tmp_path, tiny_gguf):
    result = imported("generate", str(tiny_gguf), "--prompt", "Stowage plans", "--max-tokens", "3", "--json",
                      tmp_path=tmp_path)
    assert result["status"] == 0
    reply = json.loads(result["printed"])
    assert reply["prompt_tokens"] >= 2 and 1 <= len(reply["token_ids"]) <= 3
    assert "torch" not in result["heavy"] and "transformers" not in result["heavy"]


def test_a_launched_engine_plans_the_request_sent_later(tiny_gguf):
    with EngineProcess.launch(tiny_gguf) as engine:
        engine.send(PlanRequest(48, kv_dtype="float16"))
        engine.wait_ready()
        plan = engine.server.plan()
        assert plan["context_tokens"] == 48 and plan["kv_dtype"] == "float16"
        stream = engine.complete([1, 2, 3], SamplingParams(temperature=0, max_tokens=2))
        text = "".join(stream)
        assert stream.result.completion_tokens == 2 and stream.result.text == text


def test_a_launched_engine_whose_parent_sends_nothing_ends_with_a_reason(tiny_gguf):
    engine = EngineProcess.launch(tiny_gguf)
    engine.proc.stdin.close()  # the parent gave up before it knew the request
    with pytest.raises(EngineStartError, match="stdin ended before a request came"):
        engine.wait_ready()
    assert not engine.is_alive
