"""Planning a model of experts (docs/moe.md): attention, KV cache, routers and dense parts on the GPU first, then
the experts of as many whole layers as fit, the rest on the CPU; bytes read per decode token per device."""

import json

import pytest
import torch
from moe_factory import QWEN3_30B_A3B, make_moe_model, write_sparse_moe_gguf
from transformers import AutoModelForCausalLM

from stowage.engine.planning.budgets import given_budgets
from stowage.engine.planning.inspect import inspect
from stowage.engine.planning.plan import PlanRequest, max_context, plan
from stowage.engine.planning.report import format_table, to_dict
from stowage.engine.runtime.engine import Engine
from stowage.engine.runtime.kv_cache import Sequence
from stowage.engine.units import GiB, MiB

# Q4_K: 144 bytes per 256 weights. One layer's experts: 3 x 128 x 768 x 2048 weights
EXPERTS_Q4_K = 3 * 128 * 768 * 2048 // 256 * 144
assert EXPERTS_Q4_K == 339_738_624
REQUEST = PlanRequest(16384)


@pytest.fixture(scope="module")
def info(tmp_path_factory):
    # Qwen3-30B-A3B's layers with a smaller vocabulary: a 152k-token tokenizer takes seconds to read
    path = tmp_path_factory.mktemp("q30") / "qwen3-30b-a3b-shaped.gguf"
    write_sparse_moe_gguf(path, QWEN3_30B_A3B | {"vocab_size": 32768})
    return inspect(path)


def placement_is_sound(p, info) -> None:
    for layer, (attention, experts) in enumerate(zip(p.layer_devices, p.expert_devices)):
        assert experts == "cpu" or experts == attention, f"layer {layer}: experts on {experts}, attention on {attention}"
    for d in p.devices:
        assert d.expert_bytes == sum(info.expert_bytes()[i] for i in d.experts)
        assert d.other_weights_bytes + d.expert_bytes == d.weights_bytes
    assert sum(d.weights_bytes for d in p.devices) == info.weights_bytes()  # every expert counted, once


def test_headers_give_every_layers_experts(info):
    assert info.expert_bytes() == (EXPERTS_Q4_K,) * 48
    assert info.config.num_experts == 128 and info.config.num_experts_per_tok == 8


def test_no_budget_puts_experts_on_a_gpu_without_their_attention(info):
    seen = set()
    for budget in range(1 * GiB, 24 * GiB, 256 * MiB):
        p = plan(info, REQUEST, given_budgets([budget], 64 * GiB))
        placement_is_sound(p, info)
        gpu = p.device("cuda:0")
        # experts go on in whole layers, from the first of the GPU's layers, while they fit
        assert gpu.experts == tuple(range(len(gpu.experts)))
        seen.add((len(gpu.layers), len(gpu.experts)))
    assert (48, 0) in seen  # some budget holds every layer's attention on the GPU and every expert on the CPU
    assert (48, 48) in seen and any(0 < e < 48 for _, e in seen)
    # the experts wait until every layer's attention is on the GPU
    assert all(layers == 48 for layers, experts in seen if experts)
    # two GPUs: each takes its own layers' experts, never another's
    for first, second in ((1 * GiB, 2 * GiB), (2 * GiB, 6 * GiB), (5 * GiB, 5 * GiB), (12 * GiB, 3 * GiB)):
        p = plan(info, REQUEST, given_budgets([first, second], 64 * GiB))
        placement_is_sound(p, info)
        for gpu in p.devices[:2]:
            assert set(gpu.experts) <= set(gpu.layers)


def test_attention_everywhere_first_then_the_experts_that_fit(info):
    p = plan(info, REQUEST, given_budgets([8 * GiB], 64 * GiB))
    gpu, cpu = p.device("cuda:0"), p.device("cpu")
    assert len(gpu.layers) == 48 and 0 < len(gpu.experts) < 48
    # one more layer's experts would not have fit
    assert gpu.total_bytes <= gpu.budget_bytes < gpu.total_bytes + EXPERTS_Q4_K
    assert cpu.experts == tuple(range(len(gpu.experts), 48))
    assert p.expert_devices == ("cuda:0",) * len(gpu.experts) + ("cpu",) * (48 - len(gpu.experts))


def test_bytes_read_per_token_are_the_active_experts(info):
    p = plan(info, REQUEST, given_budgets([8 * GiB], 64 * GiB))
    gpu, cpu = p.device("cuda:0"), p.device("cpu")
    # 8 of 128 experts: a sixteenth of each layer's
    assert gpu.read_bytes_per_token == sum(info.layer_bytes()) + len(gpu.experts) * EXPERTS_Q4_K // 16 \
        + info.norm.nbytes() + info.lm_head.nbytes()
    assert cpu.read_bytes_per_token == len(cpu.experts) * EXPERTS_Q4_K // 16 + info.embed.nbytes() // 32768


def test_the_slider_top_counts_every_expert(info):
    budgets = given_budgets([6 * GiB], 14 * GiB)
    largest = max_context(info, REQUEST, budgets)
    assert 0 < largest < info.max_position_embeddings
    top = plan(info, REQUEST.with_context(largest), budgets)
    assert top.fits and top.max_context_tokens == largest
    placement_is_sound(top, info)
    assert not plan(info, REQUEST.with_context(largest + 16), budgets).fits
    # what decides it is RAM: the experts that left the GPU as the KV cache grew
    assert top.device("cpu").expert_bytes > 0


def test_cpu_expert_layers_keeps_the_last_n_on_the_cpu(info):
    p = plan(info, PlanRequest(4096, cpu_expert_layers=10), given_budgets([24 * GiB], 64 * GiB))
    assert p.fits and p.device("cuda:0").experts == tuple(range(38)) and p.device("cpu").experts == tuple(range(38, 48))
    placement_is_sound(p, info)
    # asked to hold more experts than fit, the plan says so rather than moving them
    small = plan(info, PlanRequest(4096, cpu_expert_layers=0), given_budgets([8 * GiB], 64 * GiB))
    assert not small.fits and small.device("cuda:0").experts == tuple(range(48))
    # before: N above the layer count wrapped around (50 kept 2 layers' experts on the CPU, not all 48)
    for n in (48, 50, 95):
        every = plan(info, PlanRequest(4096, cpu_expert_layers=n), given_budgets([24 * GiB], 64 * GiB))
        assert every.device("cpu").experts == tuple(range(48)), n


def test_json_and_table(info):
    p = plan(info, REQUEST, given_budgets([8 * GiB], 64 * GiB))
    shown = json.loads(json.dumps(to_dict(p)))
    assert shown["expert_devices"] == list(p.expert_devices) and len(shown["expert_devices"]) == 48
    gpu = shown["devices"][0]
    assert gpu["expert_bytes"] + gpu["other_weights_bytes"] == gpu["weights_bytes"]
    assert gpu["read_bytes_per_token"] == p.device("cuda:0").read_bytes_per_token
    assert "weights read per decode token" in format_table(p)
    assert PlanRequest.from_json(PlanRequest(64, cpu_expert_layers=3).to_json()).cpu_expert_layers == 3


def test_attention_on_one_device_experts_on_another_match_transformers(tmp_path):
    """A plan with every layer's attention on the GPU and its experts on the CPU, loaded with the GPU simulated by
    the CPU: the hidden state crosses to the experts' device and back, and the logits are transformers'."""
    model_dir = make_moe_model(tmp_path / "m", "mixtral")
    info = inspect(model_dir)
    p = plan(info, PlanRequest(128, prefill_chunk=8, cpu_expert_layers=3), given_budgets([2 * GiB], 8 * GiB))
    assert p.layer_devices == ("cuda:0",) * 3 and p.expert_devices == ("cpu",) * 3
    engine = Engine.load(model_dir, p, simulate={"cuda:0": "cpu"})
    report = engine.memory_report()
    for name in ("cpu", "cuda:0"):  # the simulated GPU maps its tensors in place too
        assert report[name]["weights_mapped"] + report[name]["weights_copied"] == p.device(name).weights_bytes
    assert p.device("cpu").expert_bytes == p.device("cpu").weights_bytes - info.embed.nbytes()
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    ours = engine.model.forward(ids, Sequence(), engine.cache, all_logits=True)
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_stowage_plan_cpu_expert_layers(info, capsys):
    from stowage.engine.cli import main

    args = ["plan", str(info.model_dir), "--context", "4096", "--gpu-budget", "24GiB", "--ram-budget", "64GiB",
            "--json"]
    assert main(args + ["--cpu-expert-layers", "10"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["expert_devices"] == ["cuda:0"] * 38 + ["cpu"] * 10 and shown["layer_devices"] == ["cuda:0"] * 48
    assert main(args) == 0  # auto: all of them fit
    assert json.loads(capsys.readouterr().out)["expert_devices"] == ["cuda:0"] * 48
    with pytest.raises(SystemExit):
        main(args + ["--cpu-expert-layers", "some"])
    assert "number of layers whose experts stay on the CPU" in capsys.readouterr().err


def test_the_routed_mlp_workspace_by_hand(info):
    from stowage.engine.planning.workspace import expert_activation_bytes

    # a 512-token chunk in bf16: router logits [512, 128] (2 B) and fp32 probabilities (4 B); top-8 weights (4 B),
    # indices (8 B) and their bf16 copy (2 B); the output [512, 2048]; one expert over every token: input rows and
    # the weighted product [512, 2048] x 2, silu(gate), up and their product [512, 768] x 3, its output [512, 2048]
    router = 512 * 128 * (2 + 4) + 512 * 8 * (4 + 8 + 2)
    expert = 2 * 512 * 2048 * 2 + 3 * 512 * 768 * 2 + 512 * 2048 * 2
    assert expert_activation_bytes(info.config, chunk=512, dtype=torch.bfloat16) == router + 512 * 2048 * 2 + expert \
        == 11_198_464
    # a CPU that runs only experts (every layer's attention on the GPU) is charged them
    p = plan(info, PlanRequest(4096, cpu_expert_layers=48), given_budgets([24 * GiB], 64 * GiB))
    assert p.device("cpu").layers == () and p.device("cpu").experts == tuple(range(48))
    assert p.device("cpu").workspace.activations_bytes >= 11_198_464


def test_parameters_and_active_parameters_by_hand(info):
    # per layer: q, k, v, o 18,874,368; four norms 4,352; the router 262,144; experts 3 x 128 x 768 x 2048
    attention, experts = 18_874_368 + 4_352 + 262_144, 603_979_776
    embed = 32768 * 2048  # and the untied head as much; the final norm 2048
    assert info.num_parameters == 48 * (attention + experts) + 2 * embed + 2048 == 30_044_010_496
    assert info.num_active_parameters == 48 * (attention + experts // 16) + 2 * embed + 2048
