"""gpt-oss GGUF files (`gpt-oss`, llama.cpp's tensor names, MXFP4 experts) against transformers on the weights the
file holds (docs/moe.md, "gpt-oss")."""

import pytest
import torch

gguf = pytest.importorskip("gguf")
from factory import compare_logits_and_tokens, cpu_plan  # noqa: E402
from moe_factory import make_moe_model, write_gpt_oss_gguf  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from stowage.engine.errors import ModelFormatError  # noqa: E402
from stowage.engine.formats.config import ModelConfig  # noqa: E402
from stowage.engine.formats.gguf_model import gguf_name, hf_name  # noqa: E402
from stowage.engine.formats.source import read_config  # noqa: E402
from stowage.engine.planning import inspect  # noqa: E402
from stowage.engine.runtime.engine import Engine  # noqa: E402
from stowage.kernels import quant_linear  # noqa: E402
from stowage.kernels.quant_linear import QuantizedWeight  # noqa: E402

PROMPT = "Stowage plans memory: weights, KV cache, workspace and headroom. Pick a context size with the slider;"
EXPERTS = ("mxfp4", "q8_0", "f32")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return make_moe_model(tmp_path_factory.mktemp("hf"), "gpt_oss")


@pytest.fixture(scope="module")
def files(hf, tmp_path_factory):
    """experts' type -> (the GGUF file, the Hugging Face folder holding the weights that file holds)."""
    root = tmp_path_factory.mktemp("gguf")
    return {q: write_gpt_oss_gguf(hf, root / f"{q}.gguf", root / f"{q}-hf", q) for q in EXPERTS}


def test_llama_cpp_names_map_to_the_layouts_and_back():
    for ours, theirs in [("blk.3.attn_sinks.weight", "model.layers.3.self_attn.sinks"),
                         ("blk.0.post_attention_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
                         ("blk.1.ffn_gate_inp.bias", "model.layers.1.mlp.router.bias"),
                         ("blk.2.ffn_up_exps.bias", "model.layers.2.mlp.experts.up_proj.bias"),
                         ("blk.2.ffn_down_exps.weight", "model.layers.2.mlp.experts.down_proj.weight")]:
        assert hf_name(ours, "gpt-oss") == theirs and gguf_name(theirs, "gpt-oss") == ours


def test_the_metadata_reads_as_config_json(hf, files):
    ours, theirs = read_config(files["mxfp4"][0]), ModelConfig.from_dir(hf)
    same = ("num_experts", "num_experts_per_tok", "expert_intermediate_size", "layer_windows", "attention_sinks",
            "moe_bias", "softmax_after_topk", "swiglu_limit", "swiglu_alpha", "qkv_bias", "o_bias", "head_dim",
            "rope", "rms_norm_eps", "num_layers")
    assert {f: getattr(ours, f) for f in same} == {f: getattr(theirs, f) for f in same}
    assert ours.rope.kind == "yarn" and not ours.rope.truncate


def test_a_file_without_yarn_keys_rotates_unscaled(hf, tmp_path):
    path, _ = write_gpt_oss_gguf(hf, tmp_path / "plain.gguf", tmp_path / "plain-hf", "f32", yarn=False)
    rope = read_config(path).rope
    assert (rope.kind, rope.attention_factor, rope.theta) == ("default", 1.0, 150000.0)


@pytest.mark.parametrize("experts", EXPERTS)
def test_logits_and_greedy_tokens_match_transformers(files, experts, monkeypatch):
    path, decoded = files[experts]
    reference = AutoModelForCausalLM.from_pretrained(decoded, dtype=torch.float32).eval()
    engine = Engine.load(path, cpu_plan(path, 256, dtype="float32", prefill_chunk=7))
    up = engine.model.experts[0]["up.3"]
    if experts != "f32":
        assert isinstance(up, QuantizedWeight) and up.type_name == experts
        # one expert is one slice of the mapped 3-D tensor: expert 3 lies 3 slices past expert 0
        assert up.data_ptr() - engine.model.experts[0]["up.0"].data_ptr() == 3 * up.nbytes
    report = engine.memory_report()["cpu"]
    assert report["weights_copied"] == 0 and report["weights_mapped"] == engine.plan.device("cpu").weights_bytes
    if experts != "f32":  # the native kernels quantize activations to 16 bits per 32 (docs/moe.md); the tiles: 1e-4
        compare_logits_and_tokens(engine, reference, PROMPT, 2e-3, max_tokens=16, generate=False)
        monkeypatch.setattr(quant_linear.cpu_quant, "is_available", lambda: False)
        engine.model._native_for = (engine.cache, None)  # the decode step in torch too: the tiles' exact products
    compare_logits_and_tokens(engine, reference, PROMPT, 1e-4, max_tokens=16)


def test_the_plan_counts_each_expert_tensor_and_bias_once(files):
    info = inspect(files["mxfp4"][0])
    e, h, inter = 8, 64, 64
    blocks = e * 3 * inter * h // 32 * 17
    biases = e * (2 * inter + h) * 4
    assert info.expert_bytes() == (blocks + biases,) * 4
    assert "sinks" in info.layout.layers[0] and "router_bias" in info.layout.layers[0]


def test_missing_sinks_are_named(hf, tmp_path):
    path = tmp_path / "m.gguf"
    _drop(hf, path, tmp_path, "blk.1.attn_sinks.weight")
    with pytest.raises(ModelFormatError, match="blk.1.attn_sinks.weight"):
        inspect(path)


def _drop(hf, path, tmp_path, name):
    """The f32 file with tensor `name` left out (copied tensor by tensor through gguf-py's reader)."""
    full, _ = write_gpt_oss_gguf(hf, tmp_path / "full.gguf", tmp_path / "full-hf", "f32")
    reader = gguf.GGUFReader(full)
    w = gguf.GGUFWriter(path, "gpt-oss")
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")):
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(field.name, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(field.name, value, vtype)
    for t in reader.tensors:
        if t.name != name:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gpt_oss_20b_shaped_file_plans_from_its_headers(tmp_path):
    """gpt-oss-20b's shapes (MXFP4 experts, Q8_0 elsewhere), its data a hole: what a plan counts and charges."""
    from moe_factory import GPT_OSS_20B, write_sparse_gpt_oss_gguf

    from stowage.engine.planning.budgets import given_budgets
    from stowage.engine.planning.plan import PlanRequest, plan
    from stowage.engine.units import GiB

    path = tmp_path / "gpt-oss-20b-shaped.gguf"
    write_sparse_gpt_oss_gguf(path, GPT_OSS_20B | {"vocab_size": 32768})  # a 201k-token vocabulary reads for seconds
    info = inspect(path)
    experts = 32 * 3 * 2880 * 2880  # one layer's
    assert info.expert_bytes() == (experts // 32 * 17 + 32 * 3 * 2880 * 4,) * 24  # MXFP4 blocks, f32 biases
    assert info.config.layer_windows == (128, None) * 12
    # 20.9 B with gpt-oss's own 201k vocabulary; 4 of 32 experts read per token
    assert info.num_parameters - 2 * 2880 * (32768 - 201088) == pytest.approx(20.91e9, rel=1e-3)
    routed = 24 * (experts + 32 * 3 * 2880)  # the experts' weights and biases
    assert info.num_active_parameters == info.num_parameters - routed + routed * 4 // 32
    p = plan(info, PlanRequest(131072), given_budgets([24 * GiB], 64 * GiB))
    cpu_kv = info.kv_bytes_per_token()
    # the 12 sliding layers keep their window and a prefill chunk; the 12 full ones the whole context
    assert 12 * 131072 * cpu_kv < p.kv_bytes < 12 * 131072 * cpu_kv * 1.01
    assert all(e in ("cuda:0", "cpu") for e in p.expert_devices) and p.layer_devices == ("cuda:0",) * 24


def test_a_reply_ends_at_return_and_a_call_at_call(tmp_path):
    # review: ggml-org's gpt-oss files name only <|return|> as eos (no eot/eom): a tool call ran past <|call|>
    from moe_factory import GPT_OSS_20B, write_sparse_gpt_oss_gguf

    path = tmp_path / "gpt-oss-harmony.gguf"
    vocab = 4096
    write_sparse_gpt_oss_gguf(path, GPT_OSS_20B | {"vocab_size": vocab, "num_hidden_layers": 2},
                              specials=("<|start|>", "<|end|>", "<|return|>", "<|call|>"))
    ends = read_config(path).eos_token_ids
    assert set(ends) == {1, vocab - 2, vocab - 1}  # the file's eos, <|return|>, <|call|>; not <|end|>


@pytest.mark.parametrize("experts", ["f32", "mxfp4"])
def test_the_native_decode_step_runs_gpt_oss_as_the_torch_path(files, experts):
    """decode_layer.c with sinks, biased router and experts, top-k then softmax, the clamped SwiGLU and YaRN's scaled
    rope: three sequences decoded together give the torch path's logits, step after step (MXFP4: activations
    quantized to 16 bits per 32 in the native products)."""
    from stowage.engine.runtime.kv_cache import Sequence
    from stowage.kernels import cpu_decode

    if cpu_decode.current() is None:
        pytest.skip("no native decode library here")
    path, _ = files[experts]
    engine = Engine.load(path, cpu_plan(path, 256, dtype="float32", num_seqs=6))
    native = engine.model.native(engine.cache)
    assert native is not None and native.first == 0
    prompts = [engine.tokenizer.encode(p) for p in [PROMPT, "The quick brown fox jumps over the lazy dog.", "Café"]]
    runs = {}
    for way in ("native", "torch"):
        engine.model._native_for = (engine.cache, native if way == "native" else None)
        seqs = [Sequence() for _ in prompts]
        tokens = [engine.model.forward(ids, s, engine.cache)[-1].argmax().item() for ids, s in zip(prompts, seqs)]
        steps = []
        for step in range(12):  # past the sliding window of 8
            logits = engine.model.decode_step(tokens, seqs, engine.cache)
            steps.append(logits)
            tokens = (runs["native"][step] if way == "torch" else logits).argmax(-1).tolist()
        runs[way] = steps
        for s in seqs:
            engine.cache.release(s)
    tolerance = 1e-4 if experts == "f32" else 2e-3
    for ours, theirs in zip(runs["native"], runs["torch"]):
        assert (ours - theirs).abs().max().item() <= tolerance
