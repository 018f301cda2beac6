"""plan() and max_context() on the Llama-3.1-8B shape, against numbers worked out by hand.

Shared arithmetic (bf16 weights, fp16 KV, 32,768 tokens, block 16, prefill chunk 512):
  layer weights        436,224,000  (test_inspect.py)
  layer KV             32,768 tokens x 2 x 8 heads x 128 dims x 2 B = 134,217,728 (128 MiB)
  GPU cost of a layer  436,224,000 + 134,217,728 = 570,441,728
  embeddings           128,256 x 4,096 x 2 = 1,050,673,152  (always on the CPU)
  head                 final norm 8,192 + lm_head 1,050,673,152 = 1,050,681,344  (with the last layer)
Workspace (engine/planning/workspace.py; c = 512 tokens, a = 2 bytes, T = 32,768):
  residual 3*c*4096*a = 12,582,912; q/k/v c*48*128*a = 6,291,456 and their rotations c*40*128*a = 5,242,880
  rotary tables 2 * 32,768 rows * 128 * a = 16,777,216; MLP 3*c*14,336*a = 44,040,192
  CUDA attention (kernels/triton_attention.py): the output c*32*128*a = 4,194,304 (prefill streams K/V);
    decode's split-K partials 32 heads * 64 splits * 129 * 4 = 1,056,768 are smaller
    -> attention phase 6,291,456 + 5,242,880 + 4,194,304 = 15,728,640 < MLP 44,040,192
    -> layer peak 12,582,912 + 44,040,192 + 16,777,216 = 73,400,320
    + CUDA overhead 718,274,560 (685 MiB) = 791,674,880; with the head's logits (128,256 x 6) 792,444,416
  CPU attention (kernels/reference.py, fp32): rows = 32,768 x 8 x 128 = 33,554,432 per K (or V)
    K held in fp32 (4 B) while V is gathered (2 B) and copied to fp32 (4 B): rows x 10 = 335,544,320,
    + output 4,194,304 = 339,738,624 (the scores tile, 2 queries x 32 heads x T x 8 B, is smaller)
    -> layer peak 12,582,912 + (11,534,336 + 339,738,624) + 16,777,216 = 380,633,088
    + embedded chunk c*4096*a 4,194,304 + logits 769,536 + overhead 33,554,432 = 419,151,360
  CPU with the embeddings only: max(4,194,304, rotary build 32,768*4 + 2*32,768*64*4 = 16,908,288)
    + 33,554,432 = 50,462,720
  CPU attention in C (kernels/cpu_attention.py, where its library is): only the output c*32*128*a = 4,194,304
    -> attention phase 11,534,336 + 4,194,304 = 15,728,640 < MLP 44,040,192: layer peak 73,400,320 (as on CUDA)
    + 4,194,304 + 769,536 + 33,554,432 = 111,918,592
Budgets: GPU free - max(512 MiB, 2%); RAM available - max(1 GiB, 5%). 16 GiB RAM -> 16,106,127,360.
The tests below plan the CPU with the reference's formula (the native library switched off); the last one
checks the native kernel's. They plan for a CPU whose 16-bit products run at speed (no widened tiles):
  widened tiles (kernels/cpu_matmul.py, c = 512): the chunk in fp32, a tile of fp32 rows (1 MiB: 64 rows of
    4,096; 16 rows of 14,336) and its fp32 output; the largest is down's, 4 x (512 x 14,336 + 16 x 14,336
    + 512 x 16) = 30,310,400
"""

import pytest

from stowage.engine.planning.budgets import given_budgets
from stowage.kernels import cpu_decode, cpu_matmul
from stowage.engine.errors import InsufficientMemoryError
from stowage.engine.planning.inspect import inspect
from stowage.engine.planning.plan import PlanRequest, check, max_context, plan
from stowage.engine.planning.report import format_table, summary, to_dict
from stowage.engine.units import GiB
from sparse_models import LLAMA_3_1_8B, QWEN3_0_6B, write_sparse_model

LAYER = 436_224_000
KV = 134_217_728
EMBED = 1_050_673_152
HEAD = 1_050_681_344
GPU_WS = 791_674_880
GPU_WS_HEAD = 792_444_416
CPU_WS = 419_151_360
CPU_WS_EMBED_ONLY = 50_462_720
# The native decode step's scratch, one lane (decode_layer.c ensure_lane) for hidden 4096, 32 x 128 query heads,
# 8 KV heads, intermediate 14336: floats 5 x 4096 + 2 x 1024 + 3 x 14336 + 128 + 32 x 64 splits x 130 = 331,904
# (1,327,616 B); x's and act's integer forms (quant_blocks.h QVEC_BYTES: per 32 two floats, per 256 one, per 16 an
# int32 and an int16, three int8 planes) 1,024 + 64 + 1,536 + 12,288 and 3,584 + 224 + 5,376 + 43,008; bf16 copies
# 2 x 18,432.
DECODE_SCRATCH = 1_327_616 + 14_912 + 52_192 + 36_864
CPU_WS_NATIVE = 111_918_592 + DECODE_SCRATCH
RAM_16 = 16 * GiB - GiB
REQUEST = PlanRequest(32768, kv_dtype="float16")
WIDENED = 30_310_400


@pytest.fixture(autouse=True)
def fast_16_bit_products(monkeypatch):
    monkeypatch.setenv(cpu_matmul.WIDEN_ENV, "0")  # the figures above, whichever CPU runs the tests


@pytest.fixture(autouse=True)
def reference_on_the_cpu(monkeypatch):
    monkeypatch.setenv("STOWAGE_NATIVE_DECODE", "0")
    cpu_decode.selected_isa.cache_clear()
    yield
    monkeypatch.undo()
    cpu_decode.selected_isa.cache_clear()


@pytest.fixture(scope="module")
def info(tmp_path_factory):
    return inspect(write_sparse_model(tmp_path_factory.mktemp("llama8b"), LLAMA_3_1_8B, num_shards=4))


def test_32k_fp16_kv_is_exactly_4_gib(info):
    p = plan(info, REQUEST, given_budgets([], 64 * GiB))
    assert p.kv_bytes == 32 * 32768 * 4096 == 4 * GiB


def test_8_gib_gpu(info):
    p = plan(info, REQUEST, given_budgets([8 * GiB], 16 * GiB))
    gpu, cpu = p.devices
    # (8 GiB - 512 MiB - 791,674,880) / 570,441,728 = 12.73 -> 12 layers
    assert gpu.budget_bytes == 8 * GiB - 512 * 2**20 == 8_053_063_680
    assert gpu.layers == tuple(range(12))
    assert (gpu.weights_bytes, gpu.kv_bytes, gpu.workspace_bytes) == (12 * LAYER, 12 * KV, GPU_WS)
    assert gpu.total_bytes == 7_636_975_616
    assert gpu.headroom_bytes == 416_088_064
    # CPU: 20 layers, the embeddings and the head
    assert cpu.layers == tuple(range(12, 32))
    assert cpu.weights_bytes == 20 * LAYER + EMBED + HEAD == 10_825_834_496
    assert (cpu.kv_bytes, cpu.workspace_bytes) == (20 * KV, CPU_WS)
    assert cpu.total_bytes == 13_929_340_416 <= cpu.budget_bytes == RAM_16
    assert p.fits and p.error is None
    assert p.layer_devices == ("cuda:0",) * 12 + ("cpu",) * 20
    assert (p.embed_device, p.head_device) == ("cpu", "cpu")
    assert summary(p) == "12/32 layers on GPU 0, 20/32 on CPU, 32,768-token KV cache (4.0 GiB float16)"
    # the Triton prefill kernel streams K/V, so the chunk need not shrink as the context grows
    assert p.prefill_chunk == 512
    assert (gpu.attention, cpu.attention) == ("triton", "reference")


def test_12_gib_gpu(info):
    p = plan(info, REQUEST, given_budgets([12 * GiB], 16 * GiB))
    gpu, cpu = p.devices
    # (12 GiB - 512 MiB - 791,674,880) / 570,441,728 = 20.26 -> 20 layers
    assert gpu.layers == tuple(range(20))
    assert gpu.total_bytes == 20 * 570_441_728 + GPU_WS == 12_200_509_440
    assert cpu.weights_bytes == 12 * LAYER + EMBED + HEAD == 7_336_042_496
    assert cpu.total_bytes == 7_336_042_496 + 12 * KV + CPU_WS == 9_365_806_592
    assert p.fits


def test_24_gib_gpu_takes_every_layer_and_the_head(info):
    p = plan(info, REQUEST, given_budgets([24 * GiB], 16 * GiB))
    gpu, cpu = p.devices
    assert gpu.layers == tuple(range(32))
    assert gpu.holds == ("norm", "lm_head")
    assert gpu.total_bytes == 32 * 570_441_728 + HEAD + GPU_WS_HEAD == 20_097_261_056
    assert gpu.budget_bytes == 24 * GiB - 512 * 2**20
    assert (cpu.layers, cpu.holds) == ((), ("embed",))
    assert cpu.total_bytes == EMBED + CPU_WS_EMBED_ONLY == 1_101_135_872
    assert p.head_device == "cuda:0" and p.fits


def test_last_layer_goes_to_the_cpu_when_it_does_not_fit_with_the_head(info):
    # 32 layers without the head: 32 * 570,441,728 + 791,674,880 = 19,045,810,176 would fit in 19.05e9;
    # but the last layer brings the head: 20,097,261,056, which does not
    p = plan(info, REQUEST, given_budgets([19_050_000_000], 16 * GiB, gpu_safety_bytes=0))
    assert p.devices[0].layers == tuple(range(31))
    assert p.devices[1].layers == (31,)
    assert p.head_device == "cpu"


def test_two_gpus(info):
    p = plan(info, REQUEST, given_budgets([12 * GiB, 8 * GiB], 16 * GiB))
    gpu0, gpu1, cpu = p.devices
    assert gpu0.layers == tuple(range(20))
    # 12 layers would fit as on the lone 8 GiB GPU, but the 12th is the last and brings the head
    assert gpu1.layers == tuple(range(20, 31))
    assert gpu1.total_bytes == 11 * 570_441_728 + GPU_WS == 7_066_533_888
    assert cpu.layers == (31,)
    assert cpu.total_bytes == LAYER + EMBED + HEAD + KV + CPU_WS == 3_090_947_584
    assert summary(p).startswith("20/32 layers on GPU 0, 11/32 on GPU 1, 1/32 on CPU")


def test_no_gpu(info):
    budgets = given_budgets([], 32 * GiB)
    p = plan(info, REQUEST, budgets)
    (cpu,) = p.devices
    # 32 GiB - 5% (1,717,986,918) = 32,641,751,450 usable
    assert cpu.budget_bytes == 32_641_751_450
    assert cpu.total_bytes == 16_060_522_496 + 4 * GiB + CPU_WS == 20_774_641_152
    assert p.fits and p.prefill_chunk == 512 and p.layer_devices == ("cpu",) * 32
    # max context, in closed form: total(T) = 16,127,352,320 + 131,072 T (KV) + 10,240 T (attention's
    # gathered K/V) + 512 T (rotary rows), so T <= (32,641,751,450 - 16,127,352,320) / 141,824 = 116,443.3
    # -> 116,432 (whole blocks of 16)
    assert max_context(info, REQUEST, budgets) == 116_432
    assert p.max_context_tokens == 116_432


def test_widened_16_bit_products_charge_their_tiles(info, monkeypatch):
    # where the CPU's 16-bit products are slow, a prefill chunk's products run on widened fp32 tiles: the CPU
    # that runs layers pays the largest one's scratch on top of the same workspace
    budgets = given_budgets([], 32 * GiB)
    monkeypatch.setenv(cpu_matmul.WIDEN_ENV, "1")
    (cpu,) = plan(info, REQUEST, budgets).devices
    assert cpu.workspace.widened_bytes == WIDENED
    assert cpu.workspace_bytes == CPU_WS + WIDENED
    assert plan(info, REQUEST.with_context(8), budgets).devices[0].workspace.widened_bytes == 0  # 8 tokens


def test_a_context_that_fits_nowhere(info):
    budgets = given_budgets([], 32 * GiB)
    p = plan(info, REQUEST.with_context(131072), budgets)
    assert not p.fits
    assert "a 131,072-token context needs 16.0 GiB of KV cache (float16)" in p.error
    assert "the largest context that fits is 116,432 tokens" in p.error
    assert "RAM would hold" in p.error and "32.0 GiB free minus a 1.6 GiB reserve" in p.error
    with pytest.raises(InsufficientMemoryError, match="largest context that fits is 116,432 tokens"):
        check(info, REQUEST.with_context(131072), budgets)
    with pytest.raises(InsufficientMemoryError):
        p.require_fit()


def test_gpu_and_ram_too_small_for_128k(info):
    budgets = given_budgets([8 * GiB], 16 * GiB)
    p = plan(info, REQUEST.with_context(131072), budgets)
    largest = p.max_context_tokens
    assert not p.fits and f"the largest context that fits is {largest:,} tokens" in p.error
    assert "16.0 GiB of KV cache" in p.error and "on GPU 0 and" in p.error
    assert plan(info, REQUEST.with_context(largest), budgets).fits
    assert not plan(info, REQUEST.with_context(largest + 16), budgets).fits
    # every context up to the largest fits, none past it (what the slider and the bisection rely on)
    for tokens in range(1024, 131072, 1024):
        assert plan(info, REQUEST.with_context(tokens), budgets).fits == (tokens <= largest), tokens


def test_ram_limit_forces_an_error_not_swap(info):
    budgets = given_budgets([], 64 * GiB, ram_limit_bytes=20 * GiB)
    assert budgets.ram.budget_bytes == 20 * GiB
    assert plan(info, REQUEST, budgets).fits  # 20,774,641,152 <= 21,474,836,480
    p = plan(info, REQUEST.with_context(65536), budgets)
    assert not p.fits
    assert "capped by the 20.0 GiB RAM limit" in p.error and "never plans into swap" in p.error
    # (21,474,836,480 - 16,127,352,320) / 141,824 = 37,704.9 -> 37,696 (whole blocks of 16)
    assert p.max_context_tokens == 37_696


def test_weights_alone_too_big(info):
    p = plan(info, REQUEST.with_context(16), given_budgets([], 8 * GiB))
    assert not p.fits and p.max_context_tokens == 0
    assert "no context fits" in p.error


def test_manual_gpu_layers(info):
    budgets = given_budgets([8 * GiB], 32 * GiB)
    p = plan(info, PlanRequest(32768, kv_dtype="float16", gpu_layers=4), budgets)
    assert p.devices[0].layers == (0, 1, 2, 3) and p.fits
    over = plan(info, PlanRequest(32768, kv_dtype="float16", gpu_layers=16), budgets)
    assert over.devices[0].layers == tuple(range(16))  # placed as asked, and shown over budget
    assert not over.fits and over.devices[0].headroom_bytes < 0
    assert "fewer GPU layers (at most 12 fit with this context)" in over.error
    cpu_only = plan(info, PlanRequest(32768, kv_dtype="float16", gpu_layers=0), budgets)
    assert cpu_only.layer_devices == ("cpu",) * 32 and cpu_only.devices[0].total_bytes == 0
    everything = plan(info, PlanRequest(1024, gpu_layers=99), given_budgets([24 * GiB], 16 * GiB))
    assert everything.num_gpu_layers == 32
    no_gpu = plan(info, PlanRequest(1024, gpu_layers=4), given_budgets([], 64 * GiB))
    assert not no_gpu.fits and "there is no GPU" in no_gpu.error


def test_context_beyond_the_model(info):
    p = plan(info, PlanRequest(200_000), given_budgets([], 512 * GiB))
    assert not p.fits and "longer than the model's 131,072 positions" in p.error
    assert p.max_context_tokens == 131072


def test_kv_dtype_defaults_to_the_compute_dtype_and_fp8_halves_it(info):
    budgets = given_budgets([], 64 * GiB)
    assert plan(info, PlanRequest(32768), budgets).kv_dtype == "bfloat16"
    assert plan(info, PlanRequest(32768, kv_dtype="fp8"), budgets).kv_bytes == 2 * GiB
    converted = plan(info, PlanRequest(1024, dtype="float32"), budgets)
    assert converted.dtype == converted.kv_dtype == "float32"
    assert converted.devices[0].weights_bytes == 2 * 16_060_522_496


def test_json_shape(info):
    d = to_dict(plan(info, REQUEST, given_budgets([8 * GiB], 16 * GiB)))
    assert {"fits", "context_tokens", "max_context_tokens", "kv_dtype", "block_size", "error", "devices"} <= d.keys()
    for dev in d["devices"]:
        assert dev["total_bytes"] == dev["weights_bytes"] + dev["kv_bytes"] + dev["workspace_bytes"]
        assert dev["total_bytes"] <= dev["budget_bytes"]
    assert d["devices"][0]["layers"] == list(range(12)) and d["devices"][0]["reserve_bytes"] == 512 * 2**20
    assert [dev["attention"] for dev in d["devices"]] == ["triton", "reference"]


def test_table_lists_every_device(info):
    table = format_table(plan(info, REQUEST, given_budgets([12 * GiB, 8 * GiB], 16 * GiB)))
    assert "cuda:0" in table and "cuda:1" in table and "cpu" in table
    assert "0-19" in table and "20-30" in table and "31 +embed,norm,lm_head" in table


def test_tied_embeddings_are_copied_to_the_head_device(tmp_path):
    qwen = inspect(write_sparse_model(tmp_path, QWEN3_0_6B))
    embed = 151936 * 1024 * 2
    gpu_plan = plan(qwen, PlanRequest(4096), given_budgets([8 * GiB], 16 * GiB))
    gpu, cpu = gpu_plan.devices
    assert gpu.holds == ("norm", "lm_head") and cpu.holds == ("embed",)
    assert gpu.weights_bytes == sum(qwen.layer_bytes()) + 2048 + embed  # a copy of the embeddings
    assert cpu.weights_bytes == embed
    cpu_plan = plan(qwen, PlanRequest(4096, gpu_layers=0), given_budgets([8 * GiB], 16 * GiB))
    assert cpu_plan.devices[1].weights_bytes == qwen.weights_bytes() == sum(qwen.layer_bytes()) + embed + 2048


def test_the_native_cpu_attention_charges_only_its_output(info, monkeypatch):
    monkeypatch.delenv("STOWAGE_NATIVE_DECODE")
    cpu_decode.selected_isa.cache_clear()
    if cpu_decode.current() is None:
        pytest.skip("no native library here")
    p = plan(info, REQUEST, given_budgets([8 * GiB], 16 * GiB))
    assert p.devices[1].attention == "cpu-native" and p.devices[1].workspace_bytes == CPU_WS_NATIVE
