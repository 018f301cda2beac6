"""A checkpoint with a matrix in another float dtype than the rest loads and generates (issue 12, found by the fuzz).

The loader copies such a matrix into the compute dtype (engine/runtime/weights.py place, the names from
planning/inspect.py converted_names); the forecast counts that copy on the device that holds it, so the load
holds exactly what the plan says. Everything else stays a view of the file.
"""

import pytest
import torch
from factory import cpu_plan, make_model
from safetensors.torch import load_file, save_file

from stowage.engine.runtime.engine import Engine
from stowage.engine.planning import inspect
from stowage.engine.planning.budgets import given_budgets
from stowage.engine.planning.plan import PlanRequest, plan
from stowage.engine.runtime.sampler import SamplingParams
from stowage.engine.units import GiB

UP = "model.layers.1.mlp.up_proj.weight"
NORM = "model.layers.2.input_layernorm.weight"
EMBED = "model.embed_tokens.weight"
GREEDY = SamplingParams(temperature=0, max_tokens=6)
PROMPT = [1, 20, 30, 40, 50]


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("bf16"), "llama", dtype=torch.bfloat16)


def with_tensors(model_dir, out_dir, **dtypes):
    """A copy of model_dir whose model.safetensors holds the named tensors (UP=..., NORM=...) in other dtypes."""
    out_dir.mkdir()
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            (out_dir / f.name).write_bytes(f.read_bytes())
    tensors = load_file(model_dir / "model.safetensors")
    for key, dtype in dtypes.items():
        name = globals()[key]
        tensors[name] = tensors[name].to(dtype)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def generate(model_dir, p):
    engine = Engine.load(model_dir, p)
    try:
        tokens = engine.generate(PROMPT, GREEDY).run().token_ids
        return tokens, engine.memory_report()
    finally:
        engine.close()


def test_an_fp16_matrix_in_a_bf16_model_generates_and_matches_the_forecast(bf16_model, tmp_path):
    mixed = with_tensors(bf16_model, tmp_path / "mixed", UP=torch.float16)
    info = inspect(mixed)
    assert info.compute_dtype == "bfloat16"
    numel = 160 * 64
    # fp16 and bf16 are both 2 bytes: the forecast is the file's weights, of which this matrix is now a copy
    assert info.weights_bytes() == inspect(bf16_model).weights_bytes()
    p = cpu_plan(mixed, 64)
    tokens, report = generate(mixed, p)
    assert report["cpu"]["weights_copied"] == numel * 2
    assert report["cpu"]["weights_copied"] + report["cpu"]["weights_mapped"] == p.device("cpu").weights_bytes
    # the converted matrix computes as the same values rounded to bf16 in the file would
    rounded = with_tensors(bf16_model, tmp_path / "rounded", UP=torch.float16)
    tensors = load_file(rounded / "model.safetensors")
    tensors[UP] = tensors[UP].to(torch.bfloat16)
    save_file(tensors, rounded / "model.safetensors", metadata={"format": "pt"})
    expected, reference_report = generate(rounded, cpu_plan(rounded, 64))
    assert tokens and tokens == expected
    assert reference_report["cpu"]["weights_copied"] == 0  # nothing to convert: every tensor a view of the file


def test_an_f32_matrix_in_a_bf16_model_is_forecast_at_its_converted_size(bf16_model, tmp_path):
    mixed = with_tensors(bf16_model, tmp_path / "mixed", UP=torch.float32)
    info = inspect(mixed)
    numel = 160 * 64
    assert info.layers[1].bytes_by_dtype == {"bfloat16": info.layer_bytes()[1] - numel * 2, "float32": numel * 4}
    assert info.layer_bytes()[1] == info.layer_bytes()[0]  # counted as the bf16 copy the load makes
    assert info.weights_bytes() == inspect(bf16_model).weights_bytes()
    p = cpu_plan(mixed, 64)
    tokens, report = generate(mixed, p)
    assert tokens  # it ran: a matmul of two dtypes would have raised
    assert report["cpu"]["weights_copied"] == numel * 2
    assert report["cpu"]["weights_copied"] + report["cpu"]["weights_mapped"] == p.device("cpu").weights_bytes


def test_the_copy_is_counted_on_the_device_that_holds_it(bf16_model, tmp_path):
    # Every layer on a (simulated) GPU, the embeddings on the CPU: the converted matrix belongs to the GPU's bytes.
    mixed = with_tensors(bf16_model, tmp_path / "mixed", UP=torch.float32)
    p = plan(inspect(mixed), PlanRequest(64), given_budgets([64 * GiB], 64 * GiB))
    assert p.layer_devices == ("cuda:0",) * 3
    engine = Engine.load(mixed, p, simulate={"cuda:0": "cpu"})
    try:
        report = engine.memory_report()
        for d in p.devices:
            assert report[d.device]["weights_copied"] + report[d.device]["weights_mapped"] == d.weights_bytes, d.device
        assert engine.model.layers[1]["up"].dtype == torch.bfloat16
    finally:
        engine.close()


def test_a_vector_in_another_dtype_stays_a_view_of_the_file(bf16_model, tmp_path):
    # Norms and biases are used as stored (the forward converts them per call, as for GGUF's f32 norms).
    mixed = with_tensors(bf16_model, tmp_path / "mixed", NORM=torch.float32, UP=torch.float16)
    p = cpu_plan(mixed, 64)
    tokens, report = generate(mixed, p)
    assert tokens  # it ran: a matmul of two dtypes would have raised
    assert report["cpu"]["weights_copied"] == 160 * 64 * 2  # the fp16 matrix only
    assert report["cpu"]["weights_copied"] + report["cpu"]["weights_mapped"] == p.device("cpu").weights_bytes


def test_float8_embeddings_compute_in_float32_with_every_matrix_converted(bf16_model, tmp_path):
    # The layout's rule: a model whose embeddings are not a compute dtype computes in float32 (found by the fuzz:
    # "rms_norm not implemented for 'Float8_e5m2'" once the activations took the embeddings' dtype).
    mixed = with_tensors(bf16_model, tmp_path / "mixed", EMBED=torch.float8_e5m2)
    info = inspect(mixed)
    assert info.compute_dtype == "float32"
    p = cpu_plan(mixed, 64)
    tokens, report = generate(mixed, p)
    assert tokens
    assert report["cpu"]["weights_copied"] + report["cpu"]["weights_mapped"] == p.device("cpu").weights_bytes


def test_a_forced_dtype_still_converts_every_float_tensor(bf16_model, tmp_path):
    mixed = with_tensors(bf16_model, tmp_path / "mixed", NORM=torch.float32, UP=torch.float16)
    p = cpu_plan(mixed, 64, dtype="float32")
    tokens, report = generate(mixed, p)
    assert tokens  # it ran: a matmul of two dtypes would have raised
    assert report["cpu"]["weights_mapped"] == 64 * 4  # the one tensor already stored in float32
    assert report["cpu"]["weights_copied"] + report["cpu"]["weights_mapped"] == p.device("cpu").weights_bytes \
        == inspect(mixed).weights_bytes("float32")
