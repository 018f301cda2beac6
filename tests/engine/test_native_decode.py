"""The native CPU decode step (kernels/csrc/decode_layer.c) against the torch path, on the same loaded weights.

Two engines over the same files: one decodes through the native step, the other is held on the torch path.
Both are fed the same tokens after the same prompt, and every step's logits are compared, over contexts
that span many blocks and end in a partly filled one, for each weight and cache dtype and architecture.
"""

from __future__ import annotations

import pytest
import torch

from stowage.engine.runtime.engine import Engine
from stowage.engine.runtime.kv_cache import Sequence
from factory import cpu_plan, make_model
from isa import native_isa
from stowage.kernels import cpu_decode

pytestmark = pytest.mark.skipif(cpu_decode.current() is None,
                                reason="the native decode library cannot be built here (no C compiler)")

# logits are fp32; the native step keeps activations in fp32 where torch rounds them to the compute dtype
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 0.15, torch.float16: 0.03}


def _engines(model_dir, context, **request):
    plan = cpu_plan(model_dir, context, **request)
    native, torch_path = Engine.load(model_dir, plan), Engine.load(model_dir, plan)
    torch_path.model._native_for = (torch_path.cache, None)
    assert native.model.native(native.cache) is not None
    return native, torch_path


def _compare(native, torch_path, prompt: list[int], steps: int, tolerance: float) -> float:
    seqs = [Sequence(), Sequence()]
    a = native.model.forward(prompt, seqs[0], native.cache)
    b = torch_path.model.forward(prompt, seqs[1], torch_path.cache)
    worst = 0.0
    for i in range(steps):
        token = int(b[-1].argmax()) if i % 3 else (7 * i + 11) % b.shape[-1]  # greedy and forced tokens
        a = native.model.forward([token], seqs[0], native.cache)
        b = torch_path.model.forward([token], seqs[1], torch_path.cache)
        err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))
        worst = max(worst, err)
        assert err < tolerance, f"step {i}: relative logit error {err:.3g}"
    return worst


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_architectures_fp32(tmp_path, arch):
    extra = {"sliding_window": 24} if arch == "mistral" else {}
    model_dir = make_model(tmp_path / arch, arch, **extra)
    native, torch_path = _engines(model_dir, 256)
    prompt = [(i * 37) % 500 + 3 for i in range(45)]  # 45 tokens: a partly filled third block
    _compare(native, torch_path, prompt, 40, TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv", ["auto", "fp8", "float32"])
def test_dtypes_and_caches(tmp_path, dtype, kv):
    model_dir = make_model(tmp_path / "m", "llama", dtype=dtype)
    native, torch_path = _engines(model_dir, 256, kv_dtype=None if kv == "auto" else kv)
    prompt = [(i * 13) % 500 + 3 for i in range(70)]
    tolerance = TOLERANCE[dtype] * (2 if kv == "fp8" else 1)
    _compare(native, torch_path, prompt, 30, tolerance)


def test_tied_head_and_long_context(tmp_path):
    model_dir = make_model(tmp_path / "m", "llama", tie_word_embeddings=True, num_hidden_layers=2)
    native, torch_path = _engines(model_dir, 1024)
    prompt = [(i * 29) % 500 + 3 for i in range(700)]  # many splits of the context per KV head
    _compare(native, torch_path, prompt, 12, TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (6, 1)])
def test_query_heads_per_kv_head(tmp_path, dtype, heads, kv_heads):
    # the attention's score tiles: four keys of one head (no grouping), a group under four heads, one past four
    model_dir = make_model(tmp_path / "m", "llama", dtype=dtype, hidden_size=96, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, head_dim=32)
    native, torch_path = _engines(model_dir, 512)
    prompt = [(i * 31) % 500 + 3 for i in range(300)]  # several splits of many blocks, the last partly filled
    _compare(native, torch_path, prompt, 10, TOLERANCE[dtype])


@pytest.mark.parametrize("threads", [1, 3])
def test_thread_counts_agree(tmp_path, threads):
    model_dir = make_model(tmp_path / "m", "llama")
    before = cpu_decode.current().decode_num_threads()
    try:
        assert cpu_decode.set_threads(threads) == threads
        native, torch_path = _engines(model_dir, 256)
        _compare(native, torch_path, [5, 6, 7, 8, 9] * 9, 20, TOLERANCE[torch.float32])
    finally:
        cpu_decode.set_threads(before)


def test_greedy_generation_matches_torch_path(tmp_path):
    from stowage.engine.runtime.sampler import SamplingParams

    model_dir = make_model(tmp_path / "m", "qwen2")
    native, torch_path = _engines(model_dir, 256)
    sampling = SamplingParams(temperature=0.0, max_tokens=40)
    ids = [3, 17, 99, 250, 4, 8]
    results = [e.generate(ids, sampling).run() for e in (native, torch_path)]
    assert results[0].finish_reason == "length" and results[0].token_ids == results[1].token_ids


def test_gguf_block_types(tmp_path):
    pytest.importorskip("gguf")
    from gguf_factory import write_k_quant_gguf

    hf = make_model(tmp_path / "hf", "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2, initializer_range=0.2)
    types = {"attn_v.weight": "q6_k", "ffn_down.weight": "q6_k", "ffn_up.weight": "q5_k"}  # Q4_K_M's mix
    path, _ = write_k_quant_gguf(hf, tmp_path / "m.gguf", tmp_path / "ref", types)
    for dtype in (torch.float32, torch.bfloat16):
        native, torch_path = _engines(path, 256, dtype=str(dtype).removeprefix("torch."))
        _compare(native, torch_path, [(i * 11) % 500 + 3 for i in range(40)], 20, TOLERANCE[dtype])


@pytest.mark.parametrize("isa", list(cpu_decode.ISAS))
def test_every_instruction_set(tmp_path, monkeypatch, isa):
    with native_isa(monkeypatch, isa):
        model_dir = make_model(tmp_path / "m", "llama", dtype=torch.bfloat16, head_dim=24)  # rows of 24: no whole vectors
        native, torch_path = _engines(model_dir, 256)
        _compare(native, torch_path, [(i * 13) % 500 + 3 for i in range(50)], 20, TOLERANCE[torch.bfloat16])


ODD_ROWS = dict(hidden_size=72, intermediate_size=150)  # rows of 72 and 150: a part-vector tail in every product


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_seqs", [3, 6, 9])  # one pass of lanes; passes of 4 + 2 and 4 + 4 + 1 (AVX2)
@pytest.mark.parametrize("shape", [{}, ODD_ROWS], ids=["rows-of-64", "odd-rows"])
def test_batched_step_matches_torch_path(tmp_path, dtype, num_seqs, shape):
    # Sequences of different lengths (positions, partly filled blocks) in one step: each lane's logits equal the
    # torch batched step's, and lane b's equal what sequence b gets decoded alone.
    model_dir = make_model(tmp_path / "m", "llama", dtype=dtype, sliding_window=None, **shape)
    _batched_matches_torch_path(model_dir, [5 + 13 * b for b in range(num_seqs)], 256, TOLERANCE[dtype])


# 1,601 gate/up rows: an odd count, so a two-row pass of the batched bf16 dots ends on one row; the down product's
# rows of 1,601 are wider than 8 lanes' inputs may take in L1 (lanes go 4 at a time) and end in a 1-column tail.
WIDE_ODD = dict(hidden_size=64, intermediate_size=1601)


@pytest.mark.parametrize("num_seqs", [2, 5, 9])  # lanes of one pass of 4; one of 8; 8 + 1 (and 4 + 4 + 1 for down)
def test_batched_bf16_passes_over_wide_and_odd_rows(tmp_path, num_seqs):
    model_dir = make_model(tmp_path / "m", "llama", dtype=torch.bfloat16, sliding_window=None, **WIDE_ODD)
    _batched_matches_torch_path(model_dir, [5 + 13 * b for b in range(num_seqs)], 256, TOLERANCE[torch.bfloat16])


def test_batched_attention_splits_long_contexts_over_threads(tmp_path):
    # Contexts long enough that each lane's keys are split over the threads (one parallel call for all lanes'
    # splits), merged per lane: the same logits as the torch path and as each sequence alone.
    model_dir = make_model(tmp_path / "m", "llama", dtype=torch.bfloat16, sliding_window=None)
    before = cpu_decode.current().decode_num_threads()
    try:
        assert cpu_decode.set_threads(3) == 3
        _batched_matches_torch_path(model_dir, [300, 171, 450], 512, TOLERANCE[torch.bfloat16])
    finally:
        cpu_decode.set_threads(before)


def _batched_matches_torch_path(model_dir, prompt_lengths: list[int], context: int, tolerance: float) -> None:
    num_seqs = len(prompt_lengths)
    plan = cpu_plan(model_dir, context, num_seqs=num_seqs)
    native, torch_path = Engine.load(model_dir, plan), Engine.load(model_dir, plan)
    torch_path.model._native_for = (torch_path.cache, None)
    assert native.model.native(native.cache) is not None and num_seqs <= cpu_decode.MAX_LANES
    prompts = [[(i * 37 + 5 * b) % 500 + 3 for i in range(n)] for b, n in enumerate(prompt_lengths)]
    seqs = {}
    for name, engine in (("native", native), ("torch", torch_path)):
        seqs[name] = [Sequence() for _ in prompts]
        for seq, prompt in zip(seqs[name], prompts):
            engine.model.forward(prompt, seq, engine.cache)
    for step in range(6):
        tokens = [(11 * step + 3 * b) % 500 + 3 for b in range(num_seqs)]
        a = native.model.decode_step(tokens, seqs["native"], native.cache)
        b = torch_path.model.decode_step(tokens, seqs["torch"], torch_path.cache)
        assert a.shape == b.shape == (num_seqs, b.shape[-1])
        err = ((a - b).abs().amax(dim=-1) / b.abs().amax(dim=-1).clamp_min(1e-6)).max().item()
        assert err < tolerance, f"step {step}: relative logit error {err:.3g}"
    # lane 0 against the same sequence decoded alone, one more token
    alone = Sequence()
    native.model.forward(prompts[0] + seqs["native"][0].token_ids[len(prompts[0]):], alone, native.cache)
    together = native.model.decode_step([9] * num_seqs, seqs["native"], native.cache)[0]
    single = native.model.forward([9], alone, native.cache)[-1]
    assert ((together - single).abs().max() / single.abs().max()).item() < tolerance


def test_torch_on_one_thread_around_native_tokens(tmp_path, monkeypatch):
    # the sampler of a native decode token sees torch on one thread; the count is back afterwards
    from stowage.engine.runtime.sampler import Sampler, SamplingParams

    model_dir = make_model(tmp_path / "m", "llama")
    native, _ = _engines(model_dir, 256)
    seen, sample = [], Sampler.__call__

    def counting(self, logits, seen_ids=None):
        seen.append(torch.get_num_threads())
        return sample(self, logits, seen_ids)

    monkeypatch.setattr(Sampler, "__call__", counting)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        native.generate([3, 4, 5], SamplingParams(temperature=0.0, max_tokens=5)).run()
        assert seen == [1] * 5 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_second_model_of_other_dimensions_gets_its_own_scratch_layout(tmp_path):
    # The native scratch outlives a model: after a model with a wider hidden size and a narrower FFN, a batched
    # step of the next one must not use the first one's offsets (they overlapped its FFN rows: wrong logits).
    first = make_model(tmp_path / "a", "llama", dtype=torch.float32, sliding_window=None, **ODD_ROWS)
    second = make_model(tmp_path / "b", "llama", dtype=torch.float32, sliding_window=None)
    for model_dir in (first, second):
        plan = cpu_plan(model_dir, 128, num_seqs=3)
        native, torch_path = Engine.load(model_dir, plan), Engine.load(model_dir, plan)
        torch_path.model._native_for = (torch_path.cache, None)
        seqs = {}
        for name, engine in (("native", native), ("torch", torch_path)):
            seqs[name] = [Sequence() for _ in range(3)]
            for b, seq in enumerate(seqs[name]):
                engine.model.forward([3 + b, 17, 40 + b], seq, engine.cache)
        a = native.model.decode_step([5, 6, 7], seqs["native"], native.cache)
        b = torch_path.model.decode_step([5, 6, 7], seqs["torch"], torch_path.cache)
        err = ((a - b).abs().amax(dim=-1) / b.abs().amax(dim=-1)).max().item()
        assert err < TOLERANCE[torch.float32], f"{model_dir.name}: relative logit error {err:.3g}"


def test_two_engines_decoding_on_two_threads_at_once(tmp_path):
    # The native pool and the lanes' scratch are the process's: two engines of other dimensions decoding at the same
    # time on two threads (ctypes lets go of the GIL in the calls) get the logits each gets alone.
    import threading

    engines = [Engine.load(d, cpu_plan(d, 256, num_seqs=3)) for d in (
        make_model(tmp_path / "a", "llama", dtype=torch.float32, sliding_window=None),
        make_model(tmp_path / "b", "llama", dtype=torch.float32, sliding_window=None, **ODD_ROWS))]
    prompts = [[(i * 37 + 5 * b) % 500 + 3 for i in range(20 + 9 * b)] for b in range(3)]

    def run(engine, out):
        seqs = [Sequence() for _ in prompts]
        for seq, prompt in zip(seqs, prompts):
            engine.model.forward(prompt, seq, engine.cache)
        for step in range(12):
            out.append(engine.model.decode_step([(7 * step + b) % 500 + 3 for b in range(3)], seqs, engine.cache))
            out.append(engine.model.forward([step + 3], seqs[0], engine.cache))  # one lane: decode_layers
        for seq in seqs:
            engine.cache.release(seq)

    alone = [[], []]
    for engine, out in zip(engines, alone):
        run(engine, out)
    together = [[], []]
    threads = [threading.Thread(target=run, args=(e, out), daemon=True) for e, out in zip(engines, together)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a decode thread hung"
    for a, b in zip(alone, together):
        assert len(a) == len(b) == 24
        assert all(torch.equal(x, y) for x, y in zip(a, b))
