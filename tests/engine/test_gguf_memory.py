"""A quantized GGUF model in memory: a CPU load maps its blocks in place (nothing copied, private memory barely grows),
and a load with its heaviest prefill chunk uses what the plan forecast."""

import json

import pytest
from factory import make_model, run_fresh

gguf = pytest.importorskip("gguf")
from gguf_factory import write_random_q8_0  # noqa: E402

SCRIPT = r"""
import json, sys, torch
torch.set_num_threads(1)
from memory import anonymous_bytes
from stowage.engine.runtime.engine import Engine
from stowage.engine.runtime.sampler import SamplingParams
from factory import cpu_plan
before = anonymous_bytes()
engine = Engine.load(sys.argv[1], cpu_plan(sys.argv[1], 64))
after_load = anonymous_bytes()
report = engine.memory_report()["cpu"]
result = engine.generate([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=2)).run()
after_run = anonymous_bytes()
print(json.dumps({"load": after_load - before, "run": after_run - before, "report": report,
                  "dtype": engine.plan.dtype, "tokens": len(result.token_ids),
                  "dequant": engine.plan.device("cpu").workspace.dequant_bytes,
                  "workspace": engine.plan.device("cpu").workspace_bytes}))
"""


@pytest.mark.slow
def test_a_quantized_cpu_load_maps_the_blocks_in_place(tmp_path):
    tokenizer = make_model(tmp_path / "hf", "llama")  # only its tokenizer is used
    weight_bytes = write_random_q8_0(tmp_path / "m.gguf", tokenizer, layers=4, hidden=2048, inter=5632, heads=16,
                                     kv_heads=4, vocab=8192)
    assert weight_bytes > 190 * 2**20
    out = run_fresh(SCRIPT, tmp_path / "m.gguf")
    assert out.returncode == 0, out.stderr
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert measured["dtype"] == "bfloat16" and measured["tokens"] == 2
    # the engine's own accounting: every weight byte is mapped (the file's quantized bytes), none copied
    assert measured["report"]["weights_copied"] == 0
    assert measured["report"]["weights_mapped"] == weight_bytes
    # and the process agrees: loading grows private memory by far less than the weights
    assert measured["load"] < 0.10 * weight_bytes, measured
    # running adds transient scratch (dequantized tiles, activations) that glibc may keep for reuse: 3-47 MiB
    # measured over runs here, never more than the workspace the plan charged
    assert 0 < measured["dequant"] < 0.10 * weight_bytes
    assert measured["run"] < 0.10 * weight_bytes + measured["workspace"], measured


MEASURE = """
import json, sys
import torch
torch.set_num_threads(1)
from plan_check import check_plan
from stowage.engine.planning.budgets import given_budgets
from stowage.engine.planning.inspect import inspect
from stowage.engine.planning.plan import PlanRequest, plan
from stowage.engine.units import GiB
p = plan(inspect(sys.argv[1]), PlanRequest(131072, prefill_chunk=512), given_budgets([], 16 * GiB))
assert p.fits, p.error
(cpu,) = check_plan(sys.argv[1], p)
print(json.dumps({**cpu.__dict__, "dtype": p.dtype, "dequant": p.device("cpu").workspace.dequant_bytes}))
"""


@pytest.mark.slow
def test_a_quantized_plan_is_what_a_load_and_its_heaviest_chunk_use(tmp_path):
    # tests/engine/test_plan_measured.py's shape written as Q8_0 (the weights are quantized blocks, a chunk's products
    # run the integer tiles), at 131,072 tokens: a ~1.1 GiB plan, so glibc's +-35 MiB cannot hide a wrong term
    import torch
    from gguf_factory import write_gguf

    model_dir = make_model(tmp_path / "m", "llama", dtype=torch.float32, hidden_size=512, intermediate_size=1376,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                           max_position_embeddings=131072)
    path = write_gguf(model_dir, tmp_path / "m.gguf", "q8_0")
    out = run_fresh(MEASURE, path)
    assert out.returncode == 0, out.stderr
    cpu = json.loads(out.stdout.strip().splitlines()[-1])
    assert cpu["dtype"] == "bfloat16" and cpu["dequant"] > 0
    assert cpu["kv_bytes"] == cpu["predicted_kv_bytes"] == 4 * 131072 * 2 * 8 * 64 * 2
    assert cpu["weights_bytes"] == cpu["predicted_weights_bytes"]
    error = (cpu["peak_bytes"] - cpu["predicted_bytes"]) / cpu["predicted_bytes"]
    assert abs(error) <= 0.05, (f"measured {cpu['peak_bytes']:,} bytes, predicted {cpu['predicted_bytes']:,} "
                                f"({error:+.1%})")
