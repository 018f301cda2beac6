"""Every tensor the model reads is checked against config.json before anything is planned or loaded (issue 12).

`inspect` (what `plan` reads) and `Engine.load` both go through ModelLayout.of, so each bad file below is
refused by both with the same message; before, `plan` said "fits" and the first forward pass crashed.
"""

import json
import math
import os
from dataclasses import dataclass

import pytest
from factory import cpu_plan, save_tokenizer
from sparse_models import QWEN2_5_7B, QWEN3_0_6B, write_sparse_model

from stowage.engine.formats.config import ModelConfig
from stowage.engine.dtypes import SAFETENSORS
from stowage.engine.runtime.engine import Engine
from stowage.engine.errors import ModelFormatError
from stowage.engine.formats.layout import ModelLayout, layer_tensor_names
from stowage.engine.planning import inspect

Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"


def rewrite(model_dir, edit):
    """Rewrite model.safetensors (sparse) after `edit` changes its {name: [dtype, shape]} entries in place."""
    path = model_dir / "model.safetensors"
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    entries = {n: [e["dtype"], e["shape"]] for n, e in header.items() if n != "__metadata__"}
    edit(entries)
    header, offset = {}, 0
    for name, (dtype, shape) in entries.items():
        nbytes = math.prod(shape) * SAFETENSORS[dtype][0]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
    os.truncate(path, 8 + len(raw) + offset)


def set_config(model_dir, **changes):
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


@pytest.fixture
def qwen3(tmp_path):
    """Qwen3-0.6B's real shapes (q_proj [2048, 1024]: not square, so a transposed one shows) and a plan made on them."""
    model_dir = write_sparse_model(tmp_path / "qwen3", QWEN3_0_6B)
    save_tokenizer(model_dir)  # the loader may read the tokenizer before the weights' headers
    return model_dir, cpu_plan(model_dir, 64)


def refused_by_both(model_dir, plan) -> str:
    """The message inspect (plan's input) gives; the loader must give the same one."""
    with pytest.raises(ModelFormatError) as by_inspect:
        inspect(model_dir)
    with pytest.raises(ModelFormatError) as by_load:
        Engine.load(model_dir, plan)
    assert str(by_load.value) == str(by_inspect.value)
    return str(by_inspect.value)


def test_transposed_q_proj(qwen3):
    model_dir, plan = qwen3
    rewrite(model_dir, lambda e: e[Q].__setitem__(1, e[Q][1][::-1]))
    message = refused_by_both(model_dir, plan)
    assert f"{Q!r} has shape [1024, 2048] (bfloat16)" in message
    assert "[2048, 1024] = [num_attention_heads*head_dim, hidden_size]" in message
    assert "num_attention_heads=16, head_dim=128, hidden_size=1024" in message
    assert "transposed" in message


def test_head_dim_that_does_not_match_the_weights(qwen3):
    model_dir, plan = qwen3
    set_config(model_dir, head_dim=64)
    message = refused_by_both(model_dir, plan)
    assert "head_dim=64" in message and "[1024, 1024]" in message and Q in message


def test_integer_typed_norm(qwen3):
    model_dir, plan = qwen3
    norm = "model.layers.3.post_attention_layernorm.weight"
    rewrite(model_dir, lambda e: e[norm].__setitem__(0, "I16"))  # same size as BF16: the header alone is valid
    message = refused_by_both(model_dir, plan)
    assert f"{norm!r} is stored as int16" in message and "floating point" in message


def test_embedding_with_fewer_rows_than_vocab_size(qwen3):
    model_dir, plan = qwen3
    rewrite(model_dir, lambda e: e["model.embed_tokens.weight"].__setitem__(1, [150000, 1024]))
    message = refused_by_both(model_dir, plan)
    assert "'model.embed_tokens.weight' has shape [150000, 1024]" in message
    assert "at least 151936" in message and "vocab_size=151936" in message


def test_missing_num_key_value_heads_says_what_the_weights_imply(qwen3):
    model_dir, plan = qwen3
    set_config(model_dir, num_key_value_heads=None)  # transformers' default: num_attention_heads (16)
    message = refused_by_both(model_dir, plan)
    assert f"{K!r} has shape [1024, 1024]" in message
    assert "num_key_value_heads=16 (not in config.json: num_attention_heads" in message
    assert "the weights imply num_key_value_heads=8" in message and "add it to config.json" in message


def test_qwen3_without_head_dim_takes_transformers_default(tmp_path):
    # Qwen3Config's head_dim defaults to 128, not hidden_size / num_attention_heads (64 here).
    model_dir = write_sparse_model(tmp_path, QWEN3_0_6B)
    set_config(model_dir, head_dim=None)
    assert inspect(model_dir).config.head_dim == 128


def test_missing_head_dim_hint(tmp_path):
    config = {**QWEN2_5_7B, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "head_dim": 256}
    model_dir = write_sparse_model(tmp_path, config)
    set_config(model_dir, head_dim=None)  # hidden_size / num_attention_heads = 128
    with pytest.raises(ModelFormatError, match=r"does not set head_dim, and the weights imply head_dim=256"):
        inspect(model_dir)


@pytest.mark.parametrize("name,shape,expected", [
    ("model.layers.1.self_attn.q_proj.bias", [3584, 1], "[3584] = [num_attention_heads*head_dim]"),
    ("model.layers.1.self_attn.k_proj.bias", [3584], "[512] = [num_key_value_heads*head_dim]"),
    ("model.layers.2.mlp.down_proj.weight", [3584, 3584], "[3584, 18944] = [hidden_size, intermediate_size]"),
    ("model.layers.2.input_layernorm.weight", [3583], "[3584] = [hidden_size]"),
    ("model.norm.weight", [3584, 1], "[3584] = [hidden_size]"),
    ("lm_head.weight", [152064, 3000], "[at least 152064, 3584] = [vocab_size, hidden_size]"),
])
def test_wrong_shapes_name_tensor_and_config_values(tmp_path, name, shape, expected):
    model_dir = write_sparse_model(tmp_path, QWEN2_5_7B)
    rewrite(model_dir, lambda e: e[name].__setitem__(1, shape))
    with pytest.raises(ModelFormatError, match="weights do not match config.json") as err:
        inspect(model_dir)
    assert f"{name!r} has shape {shape}" in str(err.value) and expected in str(err.value)


def test_q_norm_must_be_head_dim_wide(tmp_path):
    model_dir = write_sparse_model(tmp_path, QWEN3_0_6B)
    name = "model.layers.5.self_attn.k_norm.weight"
    rewrite(model_dir, lambda e: e[name].__setitem__(1, [1024]))
    with pytest.raises(ModelFormatError, match=r"k_norm.weight' has shape \[1024\].*\[128\] = \[head_dim\]"):
        inspect(model_dir)


def test_every_problem_is_counted(tmp_path):
    model_dir = write_sparse_model(tmp_path, QWEN2_5_7B)
    rewrite(model_dir, lambda e: [e[f"model.layers.{i}.input_layernorm.weight"].__setitem__(0, "I16") for i in range(3)])
    with pytest.raises(ModelFormatError, match=r"and 2 more tensor problem"):
        inspect(model_dir)


def test_a_scalar_embedding_beside_a_head_is_one_problem(tmp_path):
    # found by tests/engine/test_fuzz.py: an IndexError comparing the head's rows with a 0-d embedding's
    model_dir = write_sparse_model(tmp_path, QWEN2_5_7B)
    rewrite(model_dir, lambda e: e["model.embed_tokens.weight"].__setitem__(1, []))
    with pytest.raises(ModelFormatError, match=r"'model.embed_tokens.weight' has shape \[\]"):
        inspect(model_dir)


def test_padded_embeddings_are_fine_but_a_head_past_them_is_not(tmp_path):
    model_dir = write_sparse_model(tmp_path, QWEN2_5_7B)
    rewrite(model_dir, lambda e: e["model.embed_tokens.weight"].__setitem__(1, [152128, 3584]))
    assert inspect(model_dir).layout.lm_head == "lm_head.weight"  # more rows than vocab_size: padding
    rewrite(model_dir, lambda e: e["lm_head.weight"].__setitem__(1, [152192, 3584]))
    with pytest.raises(ModelFormatError, match="could produce token ids that have no embedding"):
        inspect(model_dir)


def test_a_config_claiming_a_billion_layers_costs_nothing(tmp_path):
    model_dir = write_sparse_model(tmp_path, QWEN3_0_6B)
    set_config(model_dir, num_hidden_layers=10**9)  # building 10**9 per-layer records would take the machine
    with pytest.raises(ModelFormatError, match=r"num_hidden_layers=1000000000 is more than any model has"):
        inspect(model_dir)
    set_config(model_dir, num_hidden_layers=60_000)  # within the bound: the layout counts from the names alone
    with pytest.raises(ModelFormatError, match=r"no weights for layer\(s\) 28, 29, 30, 31, 32 of 60000"):
        inspect(model_dir)


def test_plan_and_load_agree_on_a_missing_tensor(qwen3):
    model_dir, plan = qwen3
    gone = "model.layers.7.mlp.gate_proj.weight"
    rewrite(model_dir, lambda e: e.pop(gone))
    assert gone in refused_by_both(model_dir, plan)
    from stowage.engine.cli.plan import EXIT_BAD_MODEL, run_plan
    from stowage.engine.cli import build_parser

    assert run_plan(build_parser().parse_args(["plan", str(model_dir), "--context", "64", "--ram-budget", "64GiB"])) \
        == EXIT_BAD_MODEL


@dataclass(frozen=True)
class BlockTensor:
    """A GGUF-like tensor info: the layout reads only its dtype name and shape."""

    dtype_name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel  # not read by the checks


def test_block_formats_are_weights_integers_are_not():
    config = ModelConfig.from_dict({**QWEN3_0_6B, "num_hidden_layers": 1})
    d, kv, h, i = 128, 8 * 128, 1024, 3072
    shapes = {"input_norm": (h,), "post_norm": (h,), "q": (16 * d, h), "k": (kv, h), "v": (kv, h), "o": (h, 16 * d),
              "gate": (i, h), "up": (i, h), "down": (h, i), "q_norm": (d,), "k_norm": (d,)}
    tensors = {name: BlockTensor("float32" if "norm" in short else "q4_k", shapes[short])
               for short, name in layer_tensor_names(config, 0).items()}
    tensors |= {"model.embed_tokens.weight": BlockTensor("q8_0", (151936, h)),
                "model.norm.weight": BlockTensor("float32", (h,))}
    layout = ModelLayout.of(config, tensors, "gguf-like")
    assert layout.compute_dtype() == "float32" and layout.tied
    tensors["model.norm.weight"] = BlockTensor("int32", (h,))
    with pytest.raises(ModelFormatError, match="'model.norm.weight' is stored as int32"):
        ModelLayout.of(config, tensors, "gguf-like")


def test_a_matrix_in_another_float_dtype_loads_and_generates(tmp_path):
    # found by tests/engine/test_fuzz.py: the matrix was used as stored, and the first matmul of a float32 model
    # raised "expected m1 and m2 to have the same dtype"; the loader now converts it (tests/engine/test_mixed_dtypes.py)
    import torch
    from factory import make_model
    from safetensors.torch import load_file, save_file

    from stowage.engine.runtime.sampler import SamplingParams

    model_dir = make_model(tmp_path, "llama")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"].half()
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    engine = Engine.load(model_dir, cpu_plan(model_dir, 32))
    try:
        result = engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=2)).run()
        assert result.token_ids and engine.model.layers[1]["up"].dtype == torch.float32
    finally:
        engine.close()
