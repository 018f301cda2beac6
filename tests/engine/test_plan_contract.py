"""The plan is the contract: the planner charges the kernels that will run, and the load holds what it charged,
device by device (two simulated devices stand in for a GPU and the CPU on a machine without one)."""

from dataclasses import replace

import pytest
import torch
from factory import make_model

from stowage import kernels
from stowage.engine.runtime.engine import Engine
from stowage.engine.errors import InsufficientMemoryError
from stowage.engine.planning.budgets import given_budgets
from stowage.engine.planning.inspect import inspect
from stowage.engine.planning.plan import PlanRequest, plan
from stowage.engine.units import GiB
from stowage.engine.runtime.kv_cache import Sequence

REQUEST = PlanRequest(256, prefill_chunk=64)
GPU = {"cuda:0": "cpu"}  # the plan's GPU, simulated by the CPU


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("m"), "llama", tie_word_embeddings=True)


def _padded(ops, extra: int):
    original = ops.workspace_bytes

    def workspace_bytes(**shape):
        return original(**shape) + extra

    return workspace_bytes


from stowage.kernels import cpu_decode  # noqa: E402

# the CPU runs its native attention where the library could be built, else the reference
CPU_KERNEL = "cpu_attention" if cpu_decode.current() is not None else "reference"


@pytest.mark.parametrize("device, module, gpus", [("cpu", CPU_KERNEL, []), ("cuda:0", "triton_attention", [64 * GiB])])
def test_the_planner_asks_the_kernel_that_runs_on_the_device(model_dir, monkeypatch, device, module, gpus):
    # A kernel that says it needs 1 GiB more moves that device's forecast by exactly 1 GiB: the planner restates
    # nothing of the kernel's cost, it asks.
    info, budgets = inspect(model_dir), given_budgets(gpus, 64 * GiB)
    before_plan = plan(info, REQUEST, budgets)
    before = before_plan.device(device)
    ops = kernels.attention_ops(device)
    assert ops.__name__ == f"stowage.kernels.{module}" and before.attention == ops.NAME
    monkeypatch.setattr(ops, "workspace_bytes", _padded(ops, GiB))
    after_plan = plan(info, REQUEST, budgets)
    # (the layer's peak is the larger of its attention and MLP phases: where the MLP phase was the larger, it
    # absorbs that much of the padding; the MLP phase here is 3 x 64 tokens x 160 x 4 B)
    assert GiB - 3 * 64 * 160 * 4 <= after_plan.device(device).workspace_bytes - before.workspace_bytes <= GiB
    # the other devices' kernels were not asked differently
    assert [d.workspace_bytes for d in after_plan.devices if d.device != device] == [
        d.workspace_bytes for d in before_plan.devices if d.device != device]


def test_the_engine_runs_the_kernels_the_plan_charged(model_dir):
    p = plan(inspect(model_dir), REQUEST, given_budgets([], 64 * GiB))
    engine = Engine.load(model_dir, p)
    try:
        assert engine.model.attention_kernels() == {d.device: d.attention for d in p.devices if d.layers}
    finally:
        engine.close()


def test_a_plan_that_charged_another_kernel_is_refused(model_dir):
    p = plan(inspect(model_dir), REQUEST, given_budgets([], 64 * GiB))
    wrong = replace(p, devices=tuple(replace(d, attention="triton") for d in p.devices))
    with pytest.raises(InsufficientMemoryError, match="plan again"):
        Engine.load(model_dir, wrong)


def test_the_head_on_another_device_than_the_embeddings_is_counted_where_it_is(model_dir):
    # Every layer and the (tied) head on the GPU, the embeddings on the CPU: the head is a second copy of the
    # embedding matrix and belongs to the GPU's bytes, not the CPU's.
    info = inspect(model_dir)
    p = plan(info, REQUEST, given_budgets([64 * GiB], 64 * GiB))
    gpu, cpu = p.devices
    assert (gpu.holds, cpu.holds) == (("norm", "lm_head"), ("embed",)) and not cpu.layers
    embed_bytes = info.embed.nbytes()
    assert cpu.weights_bytes == embed_bytes
    assert gpu.weights_bytes == sum(info.layer_bytes()) + info.norm.nbytes() + embed_bytes
    engine = Engine.load(model_dir, p, simulate=GPU)
    try:
        report = engine.memory_report()
        for d in p.devices:
            held = report[d.device]
            assert held["weights_copied"] + held["weights_mapped"] == d.weights_bytes, d.device
            assert held["kv_cache"] == d.kv_bytes, d.device
        # and the model runs on the split: the hidden state crosses from the embeddings' device to the layers'
        logits = engine.model.forward([1, 2, 3], Sequence(), engine.cache)
        assert logits.shape == (1, info.config.vocab_size) and torch.isfinite(logits).all()
    finally:
        engine.close()
