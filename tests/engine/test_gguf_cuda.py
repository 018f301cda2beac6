"""A GGUF model planned onto a GPU: the blocks stay blocks in VRAM, so the GPU is charged the file's quantized bytes,
and a load that puts the layers there (simulated here: this machine may have no GPU) holds the blocks as stored."""

import pytest

gguf = pytest.importorskip("gguf")
from factory import make_model  # noqa: E402
from gguf_factory import write_gguf  # noqa: E402

from stowage.engine.runtime.engine import Engine  # noqa: E402
from stowage.engine.formats.gguf_model import open_model  # noqa: E402
from stowage.engine.planning import inspect, plan_for  # noqa: E402
from stowage.engine.planning.budgets import given_budgets  # noqa: E402
from stowage.engine.units import GiB  # noqa: E402
from stowage.kernels.quant_linear import QuantizedWeight  # noqa: E402


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda")
    return write_gguf(make_model(root / "hf", "llama"), root / "tiny-q8_0.gguf", "q8_0")


def test_the_gpu_is_charged_the_quantized_bytes(q8_file):
    info = inspect(q8_file)
    p = plan_for(q8_file, 256, given_budgets([4 * GiB], 8 * GiB))
    gpu = p.device("cuda:0")
    layout, specs = info.layout, open_model(q8_file).specs
    assert gpu.layers == tuple(range(info.num_layers))
    names = [n for layer in layout.layers for n in layer.values()]
    names += [{"embed": layout.embed, "norm": layout.norm, "lm_head": layout.lm_head}[h] for h in gpu.holds]
    assert {specs[n].type_name for n in names} >= {"q8_0"}
    assert gpu.weights_bytes == sum(specs[n].nbytes for n in set(names))  # the blocks as stored, not bf16


def test_a_gpu_load_holds_the_blocks_as_stored(q8_file):
    p = plan_for(q8_file, 256, given_budgets([4 * GiB], 8 * GiB))
    engine = Engine.load(q8_file, p, simulate={"cuda:0": "cpu"})
    q = engine.model.layers[0]["q"]
    assert isinstance(q, QuantizedWeight) and q.type_name == "q8_0"
    assert engine.memory_report()["cuda:0"]["weights_mapped"] + engine.memory_report()["cuda:0"]["weights_copied"] \
        == p.device("cuda:0").weights_bytes
