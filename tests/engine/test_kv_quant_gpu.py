"""A q8_0 / q4_0 KV cache on a real GPU: the compiled Triton kernels write and read the blocks, the layer rotates
around them (kernels/kv_quant.py), and the logits follow the CPU path's on the same weights, prefill and decode.
Skipped without a CUDA device (never faked); tests/kernels/test_kv_quant_triton.py runs the kernels under Triton's
interpreter on any machine. The check runs in a child process: this pytest process has TRITON_INTERPRET set
(tests/conftest.py), which would interpret the kernels instead of compiling them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from factory import make_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernels need one")]

CHECK = """
import sys
import torch
from stowage.engine.planning import plan_for
from stowage.engine.planning.budgets import given_budgets
from stowage.engine.runtime.engine import Engine
from stowage.engine.runtime.kv_cache import Sequence
from stowage.engine.units import GiB

model_dir, kv, gpu_layers = sys.argv[1], sys.argv[2], int(sys.argv[3])
request = dict(kv_dtype=kv) | ({"gpu_layers": gpu_layers} if gpu_layers >= 0 else {})
gpu = Engine.load(model_dir, plan_for(model_dir, 512, given_budgets([8 * GiB], 16 * GiB), **request))
cpu = Engine.load(model_dir, plan_for(model_dir, 512, given_budgets([], 16 * GiB), kv_dtype=kv))
assert gpu.model.layers[0].device.type == "cuda" and gpu.cache.k_cache[0].device.type == "cuda"
assert cpu.model.layers[0].device.type == "cpu"
if gpu_layers >= 0:  # the rest on the CPU: its layers and head in the native step, fed from the GPU's output
    assert [l.device.type for l in gpu.model.layers] == ["cuda"] * gpu_layers + ["cpu"] * (3 - gpu_layers)
prompt = [(i * 37) % 500 + 3 for i in range(300)]  # more than one prefill chunk of 256
seqs = Sequence(), Sequence()
a = gpu.model.forward(prompt, seqs[0], gpu.cache, all_logits=True).float().cpu()
b = cpu.model.forward(prompt, seqs[1], cpu.cache, all_logits=True).float()
# bf16 on both, rounded and quantized in different orders: close, the same choices nearly everywhere
err = float((a - b).abs().max() / b.abs().max())
agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
assert err <= 0.05 and agree >= 0.9, (kv, "prefill", err, agree)
for step in range(8):  # decode: each new token written into the blocks on the GPU, then read back
    token = int(b[-1].argmax())
    a = gpu.model.forward([token], seqs[0], gpu.cache).float().cpu()
    b = cpu.model.forward([token], seqs[1], cpu.cache).float()
    err = max(err, float((a - b).abs().max() / b.abs().max()))
    assert err <= 0.05, (kv, step, err)
print(f"ok {kv} relative error {err:.2e}, greedy agreement {agree:.3f}")
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("kvgpu"), "llama", hidden_size=256, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, initializer_range=0.05)


@pytest.mark.parametrize("kv,gpu_layers", [("q8_0", -1), ("q4_0", -1), ("q8_0/q4_0", -1), ("bfloat16", 2),
                                           ("q4_0", 2)], ids=["q8_0", "q4_0", "q8_0-q4_0", "split-bf16", "split-q4_0"])
def test_a_quantized_cache_on_the_gpu_follows_the_cpu(model_dir, kv, gpu_layers):
    """All layers on the GPU, or (split) two there and the third on the CPU, where the native step takes the GPU's
    output (bench/gpu_decode.py's split run crashed the process on its first token before that was copied over)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1] / "support"), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-P", "-c", CHECK, str(model_dir), kv, str(gpu_layers)], env=env,
                         capture_output=True, text=True, timeout=300)
    print(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith(f"ok {kv} ")
