"""The KV cache in ggml's q8_0 and q4_0 blocks (kernels/kv_quant.py): the format against the gguf package's numpy
quantizers, native attention reading it in place against the torch reference on the same cache, the decode step's
own writes, generation, the planner's bytes, and the KV store."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from factory import cpu_plan, make_model
from isa import native_isa
from stowage.engine.dtypes import kv_dtypes, kv_name
from stowage.engine.errors import InvalidArgumentError
from stowage.engine.runtime.engine import Engine
from stowage.engine.runtime.kv_cache import CacheSpec, Sequence
from stowage.kernels import cpu_attention, cpu_decode, kv_quant, reference

Q8, Q4 = torch.int8, torch.uint8
needs_native = pytest.mark.skipif(cpu_decode.current() is None, reason="no native library (no C compiler)")


def _values(seed: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 4  # a scale per row
    x[0, 0, :32] = 0  # a block of zeros: d = 0
    x[0, 1, :32] = -3.0  # every value the largest magnitude (ties; q4_0 takes the first, negative)
    x[0, 1, 5] = 2.0
    return x


@pytest.mark.parametrize("dtype,ggml", [(Q8, "Q8_0"), (Q4, "Q4_0")])
def test_blocks_are_ggml_bit_for_bit(dtype, ggml):
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    x = _values(0, 40, 4, 96)
    ours = kv_quant.quantize(x, dtype)
    assert ours.shape == (40, 4, 96 // 32 * kv_quant.FORMATS[dtype].block_bytes) and ours.dtype == dtype
    kind = getattr(gguf.GGMLQuantizationType, ggml)
    theirs = quants.quantize(x.numpy().reshape(-1, 96), kind)
    assert np.array_equal(ours.view(torch.uint8).numpy().reshape(theirs.shape), theirs)
    back = quants.dequantize(theirs, kind).reshape(x.shape)
    assert np.array_equal(kv_quant.dequantize(ours).numpy(), back)
    # within half a step (q8_0; the fp16 scale's rounding adds up to 127 * 2^-11 of a step) or one (q4_0: +8 is 7)
    step = x.abs().reshape(-1, 32).amax(1) / (127 if dtype == Q8 else 8)
    err = (kv_quant.dequantize(ours) - x).abs().reshape(-1, 32).amax(1)
    assert bool((err <= step * (0.57 if dtype == Q8 else 1.0) + 1e-6).all())


def test_kv_names_and_the_bytes_of_a_row():
    assert kv_dtypes("q8_0") == (Q8, Q8) and kv_dtypes("q8_0/q4_0") == (Q8, Q4)
    assert kv_name("bf16/q4_0") == "bfloat16/q4_0" and kv_name("q8_0/q8_0") == "q8_0"
    with pytest.raises(ValueError, match="q5_0"):
        kv_dtypes("q8_0/q5_0")
    # Llama 3 8B's shape: 8 KV heads of 128, 32 layers; 32k tokens of bf16 K/V are 4 GiB, q8_0 34/64 of it
    for k, v, gib in [(Q8, None, 2.125), (Q4, None, 1.125), (Q8, Q4, 1.625), (torch.bfloat16, Q4, 2.5625)]:
        spec = CacheSpec(num_kv_heads=8, head_dim=128, dtype=k, block_size=16, v_dtype=v)
        assert 32 * spec.layer_bytes(32_768) == gib * 2**30
    assert CacheSpec(8, 128, Q4).kv_block_bytes == (16 * 8 * 72, 16 * 8 * 72)
    with pytest.raises(InvalidArgumentError, match="multiple of 32"):
        CacheSpec(num_kv_heads=2, head_dim=48, dtype=torch.bfloat16, v_dtype=Q4)


def _cache(k_dtype, v_dtype, *, n=150, kvh=2, hd=64, bs=16, seed=1):
    """A cache of n tokens written through the reference's write_kv, its block table shuffled."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-n // bs) + 3
    kc = torch.zeros(nb, bs, kvh, kv_quant.row_elems(k_dtype, hd), dtype=k_dtype)
    vc = torch.zeros(nb, bs, kvh, kv_quant.row_elems(v_dtype, hd), dtype=v_dtype)
    table = torch.randperm(nb, generator=g)[: -(-n // bs)].to(torch.int32)
    slots = table.long()[torch.arange(n) // bs] * bs + torch.arange(n) % bs
    k, v = torch.randn(n, kvh, hd, generator=g) * 2, torch.randn(n, kvh, hd, generator=g)
    reference.write_kv(k, v, kc, vc, slots)
    return kc, vc, table, k, v


TYPES = [(Q8, Q8), (Q4, Q4), (Q8, Q4), (torch.bfloat16, Q4)]


def test_rows_in_blocks_rotate_by_an_orthonormal_involution():
    assert [kv_quant.rotation_size(Q4, hd) for hd in (32, 64, 96, 128, 256)] == [32, 64, 32, 128, 256]
    assert kv_quant.rotation_size(Q8, 192) == 64 and kv_quant.rotation_size(torch.bfloat16, 64) == 0
    assert CacheSpec(2, 96, torch.bfloat16, v_dtype=Q4).rotations == (0, 32)
    g = torch.Generator().manual_seed(4)
    for n, hd in ((32, 96), (64, 64), (256, 256)):
        x, y = torch.randn(5, 3, hd, generator=g), torch.randn(5, 3, hd, generator=g)
        hx, hy = kv_quant.hadamard(x, n), kv_quant.hadamard(y, n)
        assert torch.allclose(kv_quant.hadamard(hx, n), x, atol=1e-5)  # its own inverse
        assert torch.allclose((hx * hy).sum(-1), (x * y).sum(-1), atol=1e-4)  # dot products kept
        assert torch.allclose(hx.norm(dim=-1), x.norm(dim=-1), atol=1e-4)
        assert not torch.allclose(hx, x, atol=0.1)
        # each run of n on its own: a value moves only within its run
        e = torch.zeros(hd)
        e[n + 1 if hd > n else 1] = 1.0
        moved = kv_quant.hadamard(e, n).nonzero().flatten()
        assert set(moved.tolist()) == set(range(n if hd > n else 0, 2 * n if hd > n else n))
    assert kv_quant.hadamard(x, 0) is x


def test_rotation_spreads_a_large_key_channel():
    """Keys with a few channels far larger than the rest (as RoPE pairs make them): in q4_0 the rotated cache's
    attention is much nearer the exact one than the plain cache's, as the model reads it (query rotated too)."""
    g = torch.Generator().manual_seed(5)
    n, kvh, hd = 150, 2, 64
    k = torch.randn(n, kvh, hd, generator=g)
    k[..., 6:8] *= 25
    v = torch.randn(n, kvh, hd, generator=g)
    q = torch.randn(40, 8, hd, generator=g)
    q[..., 6:8] *= 3
    table = torch.arange(-(-n // 16), dtype=torch.int32)
    slots = torch.arange(n)

    def attention(dtype, rot):  # K in dtype, V in float32 (the keys' share of the error alone)
        kc = torch.zeros(len(table), 16, kvh, kv_quant.row_elems(dtype, hd), dtype=dtype)
        vc = torch.zeros(len(table), 16, kvh, hd)
        reference.write_kv(kv_quant.hadamard(k, rot), v, kc, vc, slots)
        return reference.prefill_attention(kv_quant.hadamard(q, rot), kc, vc, table, 110, 0.125)

    exact = attention(torch.float32, 0)
    assert torch.allclose(attention(torch.float32, 64), exact, atol=1e-4)  # exact arithmetic: no change
    plain = float((attention(Q4, 0) - exact).norm() / exact.norm())
    rotated = float((attention(Q4, 64) - exact).norm() / exact.norm())
    assert rotated < 0.6 * plain, (plain, rotated)


@pytest.mark.parametrize("kv", ["q8_0", "bfloat16/q4_0"])
def test_the_model_stores_rows_in_blocks_rotated(model_dir, kv):
    """What a cache in blocks holds is the rotation of what a float cache holds (K's and V's apart)."""
    prompt = [(i * 13) % 500 + 3 for i in range(40)]
    held = []
    for name in (kv, "float32"):
        engine = Engine.load(model_dir, cpu_plan(model_dir, 64, kv_dtype=name))
        seq = Sequence()
        engine.model.forward(prompt, seq, engine.cache)
        bs, table = engine.cache.spec.block_size, torch.tensor(seq.block_table)
        slots = table[torch.arange(len(prompt)) // bs] * bs + torch.arange(len(prompt)) % bs
        held.append([(c[0].reshape(-1, *c[0].shape[2:])[slots]) for c in (engine.cache.k_cache, engine.cache.v_cache)])
    for quantized, wide, dtype in zip(held[0], held[1], kv_dtypes(kv)):
        rot = kv_quant.rotation_size(dtype, 32)
        back = kv_quant.dequantize(quantized) if rot else quantized.float()
        err = float((back - kv_quant.hadamard(wide, rot)).abs().max() / wide.abs().max())
        assert err < (0.02 if dtype == Q8 else 0.15 if rot else 0.01), (dtype, err)
        if rot:
            assert float((back - wide).abs().max() / wide.abs().max()) > 0.2  # not the unrotated rows


@needs_native
@pytest.mark.parametrize("k_dtype,v_dtype", TYPES, ids=["q8_0", "q4_0", "q8_0-q4_0", "bf16-q4_0"])
@pytest.mark.parametrize("options", [{}, {"window": 33}, {"softcap": 20.0}], ids=["full", "window", "softcap"])
def test_native_attention_reads_quantized_blocks_as_the_reference(k_dtype, v_dtype, options):
    kc, vc, table, _, _ = _cache(k_dtype, v_dtype)
    for q_dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 8e-3)):
        q = torch.randn(40, 8, 64, generator=torch.Generator().manual_seed(2)).to(q_dtype)  # 4 heads per KV head
        ours = cpu_attention.prefill_attention(q, kc, vc, table, 110, 0.125, **options)
        oracle = reference.prefill_attention(q, kc, vc, table, 110, 0.125, **options)
        assert (ours.float() - oracle.float()).abs().max() <= tol * oracle.float().abs().max()
        one = cpu_attention.decode_attention(q[-1:], kc, vc, table[None], torch.tensor([150]), 0.125, **options)
        assert (one.float() - oracle[-1:].float()).abs().max() <= tol * oracle.float().abs().max()


@needs_native
@pytest.mark.parametrize("isa", list(cpu_decode.ISAS))
def test_every_instruction_set_reads_both_formats(monkeypatch, isa):
    with native_isa(monkeypatch, isa):
        for k_dtype, v_dtype in ((Q8, Q4), (Q4, Q8)):
            kc, vc, table, _, _ = _cache(k_dtype, v_dtype, kvh=1, hd=96)
            q = torch.randn(20, 3, 96, generator=torch.Generator().manual_seed(3))
            ours = cpu_attention.prefill_attention(q, kc, vc, table, 130, 0.1)
            oracle = reference.prefill_attention(q, kc, vc, table, 130, 0.1)
            assert (ours - oracle).abs().max() <= 2e-6 * oracle.abs().max()


@pytest.mark.parametrize("dtype,tolerance", [(Q8, 0.02), (Q4, 0.2)])
def test_quantized_attention_is_near_the_bf16_caches(dtype, tolerance):
    kc, vc, table, k, v = _cache(dtype, dtype)
    bc, bv, _, _, _ = _cache(torch.bfloat16, torch.bfloat16)  # the same seed: the same K/V and table
    q = torch.randn(40, 8, 64, generator=torch.Generator().manual_seed(2))
    wide = reference.prefill_attention(q, bc, bv, table, 110, 0.125)
    for ops in (reference, cpu_attention) if cpu_decode.current() else (reference,):
        out = ops.prefill_attention(q, kc, vc, table, 110, 0.125)
        err = float((out - wide).abs().max() / wide.abs().max())
        assert 0 < err < tolerance, f"{ops.NAME}: {err:.3g}"


def _engines(model_dir, context, **request):
    plan = cpu_plan(model_dir, context, **request)
    native, torch_path = Engine.load(model_dir, plan), Engine.load(model_dir, plan)
    torch_path.model._native_for = (torch_path.cache, None)  # held on the torch path (test_native_decode.py)
    return native, torch_path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head_dim 32: one block per row; 6 heads over 2 KV heads
    return make_model(tmp_path_factory.mktemp("kvq"), "llama", hidden_size=96, num_attention_heads=6,
                      num_key_value_heads=2, head_dim=32, initializer_range=0.2)


@pytest.fixture(scope="module")
def model_dir_96(tmp_path_factory):
    # head_dim 96: three runs of 32 rotated apart in each row
    return make_model(tmp_path_factory.mktemp("kvq96"), "llama", hidden_size=192, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=96, initializer_range=0.2)


@needs_native
@pytest.mark.parametrize("kv,head_dim", [("q8_0", 32), ("q4_0", 32), ("q8_0/q4_0", 32), ("q4_0", 96),
                                         ("bfloat16/q8_0", 96)])
def test_native_decode_step_writes_and_reads_the_blocks(model_dir, model_dir_96, kv, head_dim):
    """The C step rotates, quantizes, reads and rotates back as the torch path does (kernels/kv_quant.py)."""
    native, torch_path = _engines(model_dir if head_dim == 32 else model_dir_96, 256, kv_dtype=kv)
    assert native.model.native(native.cache) is not None
    assert native.cache.k_cache[0].dtype == kv_dtypes(kv)[0] and native.cache.v_cache[0].dtype == kv_dtypes(kv)[1]
    seqs = [Sequence(), Sequence()]
    prompt = [(i * 13) % 500 + 3 for i in range(45)]
    a = native.model.forward(prompt, seqs[0], native.cache)
    b = torch_path.model.forward(prompt, seqs[1], torch_path.cache)
    for i in range(30):  # the C step quantizes each new token's K/V itself; the torch path through write_kv
        token = int(b[-1].argmax()) if i % 3 else (7 * i + 11) % 500
        a = native.model.forward([token], seqs[0], native.cache)
        b = torch_path.model.forward([token], seqs[1], torch_path.cache)
        assert float((a - b).abs().max() / b.abs().max()) < 1e-3, f"step {i}"
    # the decoded tokens' rows, quantized in C and in torch from (nearly) the same K/V: the same blocks
    for caches in ((native.cache.k_cache, torch_path.cache.k_cache), (native.cache.v_cache, torch_path.cache.v_cache)):
        for x, y in zip(*caches):
            if kv_quant.block_format(x.dtype) is None:
                continue
            wide_x, wide_y = kv_quant.dequantize(x), kv_quant.dequantize(y)
            assert (wide_x - wide_y).abs().max() <= 0.05 * wide_y.abs().max()
            assert (x == y).float().mean() > 0.97


@pytest.mark.parametrize("kv", ["q8_0", "q4_0", "bfloat16/q4_0"])
def test_greedy_generation_runs_on_each_type(model_dir, kv):
    from stowage.engine.runtime.sampler import SamplingParams

    engine = Engine.load(model_dir, cpu_plan(model_dir, 128, kv_dtype=kv))
    engine.eos_ids.clear()
    result = engine.generate([3, 17, 99, 250, 4, 8] * 8, SamplingParams(temperature=0.0, max_tokens=24)).run()
    assert result.finish_reason == "length" and len(result.token_ids) == 24
    baseline = Engine.load(model_dir, cpu_plan(model_dir, 128, kv_dtype="float32"))
    baseline.eos_ids.clear()
    first = baseline.generate([3, 17, 99, 250, 4, 8] * 8, SamplingParams(temperature=0.0, max_tokens=1)).run()
    assert result.token_ids[0] == first.token_ids[0]


def test_plan_charges_blocks_and_scales_for_32k_tokens(tmp_path):
    model = make_model(tmp_path / "m", "llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, max_position_embeddings=32_768)
    for kv, row_bytes in [("q8_0", 2 * 34 + 2 * 34), ("q4_0", 2 * 18 + 2 * 18), ("q8_0/q4_0", 2 * 34 + 2 * 18),
                          ("bfloat16", 128 + 128)]:
        plan = cpu_plan(model, 32_768, kv_dtype=kv)
        formula = 3 * 32_768 * 2 * row_bytes  # layers * tokens * KV heads * (K's + V's bytes of a head's row)
        assert abs(plan.kv_bytes - formula) <= 0.001 * formula and plan.kv_dtype == kv
    with pytest.raises(InvalidArgumentError, match="multiple of 32"):
        cpu_plan(make_model(tmp_path / "h16", "llama"), 256, kv_dtype="q4_0")  # head_dim 16


def test_the_kv_store_reads_quantized_blocks_back(model_dir, tmp_path):
    from stowage.engine.planning import plan_for
    from stowage.engine.planning.budgets import DiskBudget, given_budgets
    from stowage.engine.serving.kv_store import KVStore
    from stowage.engine.units import GiB

    budgets = given_budgets([], 64 * GiB, disk=DiskBudget(str(tmp_path), 100 * GiB))
    engine = Engine.load(model_dir, plan_for(model_dir, 256, budgets, kv_disk_budget=GiB, kv_dtype="q8_0/q4_0"))
    store, cache, model = KVStore.of(engine), engine.cache, engine.model
    prompt = [3 + (7 * i) % 500 for i in range(150)]
    seq = Sequence()
    model.forward(prompt[:100], seq, cache)
    store.save(seq)
    kept = model.forward(prompt[100:], seq, cache, all_logits=True)
    cache.release(seq)
    entry, n = store.best(prompt)
    back = Sequence()
    assert n == 100 and store.load(entry, n, back)
    assert torch.equal(model.forward(prompt[100:], back, cache, all_logits=True), kept)


def test_plan_cli_takes_k_and_v_types(model_dir, capsys):
    import json

    from stowage.engine.cli import main

    assert main(["plan", str(model_dir), "--context", "256", "--kv-dtype", "q8_0/bf16", "--ram-budget", "8GiB",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_dtype"] == "q8_0/bfloat16"
    assert sum(d["kv_bytes"] for d in plan["devices"]) == 3 * 256 * 2 * (34 + 64)  # layers * tokens * KV heads * (a q8_0 K row + a bf16 V row)
    with pytest.raises(SystemExit):
        main(["plan", str(model_dir), "--kv-dtype", "q5_0"])
    assert "q5_0" in capsys.readouterr().err
