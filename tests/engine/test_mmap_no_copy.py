"""Loading a model whose weights stay on the CPU in their stored dtype copies nothing."""

import json

import torch
from factory import run_fresh
from safetensors.torch import save_file

from stowage.engine.formats.layout import layer_tensor_names

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
engine.generate([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=4)).run()
after_run = anonymous_bytes()
print(json.dumps({"load": after_load - before, "run": after_run - before, "report": report}))
"""


def write_bf16_model(d, layers=6, hidden=1024, inter=2816, vocab=8192):
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": 8,
              "num_key_value_heads": 2, "vocab_size": vocab, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "eos_token_id": 2}
    (d / "config.json").write_text(json.dumps(config))
    from stowage.engine.formats.config import ModelConfig
    cfg = ModelConfig.from_dict(config)
    kv = 2 * 128
    shapes = {"q": (hidden, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, hidden),
              "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter),
              "input_norm": (hidden,), "post_norm": (hidden,)}
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g).to(torch.bfloat16) * 0.02,
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        for short, name in layer_tensor_names(cfg, i).items():
            tensors[name] = (torch.randn(shapes[short], generator=g) * 0.02).to(torch.bfloat16)
    save_file(tensors, d / "model.safetensors")
    from factory import save_tokenizer
    save_tokenizer(d)
    return sum(t.numel() * 2 for t in tensors.values())


def test_cpu_load_maps_weights_in_place(tmp_path):
    weight_bytes = write_bf16_model(tmp_path)
    assert weight_bytes > 140 * 2**20
    out = run_fresh(SCRIPT, tmp_path)
    assert out.returncode == 0, out.stderr
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    # the engine's own accounting: every weight byte is mapped, none copied
    assert measured["report"]["weights_copied"] == 0
    assert measured["report"]["weights_mapped"] == weight_bytes
    # and the process agrees: private memory grows by far less than the weights (KV cache, torch runtime)
    assert measured["load"] < 0.10 * weight_bytes, measured
    assert measured["run"] < 0.10 * weight_bytes, measured
