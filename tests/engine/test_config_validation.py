"""config.json values are type- and range-checked, and every JSON file of a model folder is refused cleanly (issue 12)."""

import json
import math
import os

import pytest
from factory import make_model, run_fresh
from sparse_models import LLAMA_3_1_8B

from stowage.engine.formats.config import ModelConfig
from stowage.engine.errors import ModelFormatError, UnsupportedModelError
from stowage.engine.text.tokenizer import Tokenizer

LLAMA3_ROPE = LLAMA_3_1_8B["rope_scaling"]


@pytest.mark.parametrize("changes,message", [
    ({"rope_theta": 0}, "rope_theta must be a positive number, got 0"),
    ({"rope_theta": -10000.0}, "rope_theta must be a positive number"),
    ({"rope_theta": math.nan}, "rope_theta must be a positive number, got nan"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps must be a positive number"),
    ({"rms_norm_eps": 0}, "rms_norm_eps must be a positive number"),
    ({"rms_norm_eps": math.inf}, "rms_norm_eps must be a positive number, got inf"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer, got 0"),
    ({"max_position_embeddings": -4096}, "max_position_embeddings must be a positive integer"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer"),
    ({"hidden_size": 4096.5}, "hidden_size must be an integer, got 4096.5"),
    ({"hidden_size": "4096"}, "hidden_size must be an integer, got '4096'"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be an integer, got True"),
    ({"num_hidden_layers": -1}, "num_layers must be a positive integer"),
    ({"num_attention_heads": 0}, "num_heads must be a positive integer"),
    ({"num_key_value_heads": 0}, "num_kv_heads must be a positive integer"),
    ({"num_key_value_heads": 6}, r"num_attention_heads \(32\) is not a multiple of num_key_value_heads \(6\)"),
    ({"head_dim": 127}, "head_dim must be even, got 127"),
    ({"head_dim": None, "hidden_size": 4100}, r"hidden_size \(4100\) is not a multiple of num_attention_heads"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    ({"vocab_size": None}, "missing required key 'vocab_size'"),
    ({"intermediate_size": [14336]}, "intermediate_size must be an integer"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ({"rope_scaling": [8.0]}, "rope_scaling must be an object"),
    ({"rope_scaling": {**LLAMA3_ROPE, "low_freq_factor": 4.0}}, "0 < low_freq_factor < high_freq_factor"),
    ({"rope_scaling": {**LLAMA3_ROPE, "factor": -8.0}}, "rope factor must be a positive number"),
    ({"rope_scaling": {**LLAMA3_ROPE, "factor": None}}, "missing required key 'factor'"),
    ({"rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 0}}, "original_max_position_embeddings"),
    ({"architectures": 3}, "architectures must be a list"),
    ({"model_type": ["llama"]}, "model_type must be a string"),
])
def test_bad_values_are_refused_naming_the_key(changes, message):
    raw = {k: v for k, v in {**LLAMA_3_1_8B, **changes}.items() if v is not None}
    with pytest.raises(ModelFormatError, match=message):
        ModelConfig.from_dict(raw)


def test_unknown_rope_type_is_unsupported():
    with pytest.raises(UnsupportedModelError, match="rope type 'longrope'"):
        ModelConfig.from_dict({**LLAMA_3_1_8B, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})


def test_rope_scaling_beside_rope_parameters_is_merged_when_they_agree():
    # transformers 5 writes rope_parameters; a file converted from an older one may keep rope_scaling too.
    config = ModelConfig.from_dict({**LLAMA_3_1_8B, "rope_theta": None, "rope_scaling": {"type": "llama3", **{
        k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}}, "rope_parameters": {"rope_theta": 500000.0}})
    assert config.rope.kind == "llama3" and config.rope.theta == 500000.0 and config.rope.factor == 8.0


@pytest.mark.parametrize("changes,key", [
    # transformers would use rope_scaling and drop rope_parameters without a word; we refuse to guess
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, "rope_type"),
    ({"rope_parameters": {**LLAMA3_ROPE, "factor": 32.0}}, "factor"),
    ({"rope_theta": 10000.0, "rope_parameters": {"rope_theta": 500000.0}, "rope_scaling": None}, "rope_theta"),
])
def test_rope_sources_that_disagree_are_refused(changes, key):
    with pytest.raises(ModelFormatError, match=f"disagree on {key}"):
        ModelConfig.from_dict({**LLAMA_3_1_8B, **changes})


def test_rope_parameters_per_layer_type_are_unsupported():
    nested = {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(UnsupportedModelError, match="per layer type"):
        ModelConfig.from_dict({**LLAMA_3_1_8B, "rope_scaling": None, "rope_parameters": nested})


def test_absent_key_defaults_are_recorded():
    config = ModelConfig.from_dict({k: v for k, v in LLAMA_3_1_8B.items() if k not in ("num_key_value_heads", "head_dim")})
    assert config.num_kv_heads == 32 and config.head_dim == 128
    assert set(config.implied) == {"num_key_value_heads", "head_dim"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture
def folder(tiny, tmp_path):
    """A copy of the tiny model's small files (the weights are linked)."""
    for f in tiny.iterdir():
        if f.suffix == ".safetensors":
            os.link(f, tmp_path / f.name)
        else:
            (tmp_path / f.name).write_bytes(f.read_bytes())
    return tmp_path


BAD_JSON = {
    "a list": (b"[1, 2]", "holds a list, not a JSON object"),
    "null": (b"null", "holds null, not a JSON object"),
    "a number": (b"4096", "holds a number, not a JSON object"),
    "not UTF-8": (b'{"model_type": "\xff\xfe"}', r"not UTF-8 text \(byte 0xff at offset 16\)"),
    "not JSON": (b'{"model_type": ', "not valid JSON"),
    "empty": (b"", "not valid JSON"),
    "deeply nested": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply|not valid JSON"),
    "a huge integer": (b'{"vocab_size": ' + b"9" * 5000 + b"}", "not valid JSON"),
}


def load_tokenizer_and_config(model_dir):
    ModelConfig.from_dir(model_dir)
    Tokenizer(model_dir)


@pytest.mark.parametrize("file", ["config.json", "tokenizer_config.json", "generation_config.json"])
@pytest.mark.parametrize("kind", list(BAD_JSON))
def test_json_files_that_are_not_objects_name_the_file(folder, file, kind):
    data, message = BAD_JSON[kind]
    (folder / file).write_bytes(data)
    with pytest.raises(ModelFormatError, match=message) as err:
        load_tokenizer_and_config(folder)
    assert file in str(err.value)


FIFO_SCRIPT = """
import sys
from stowage.engine.formats.config import ModelConfig
from stowage.engine.errors import ModelFormatError
from stowage.engine.text.tokenizer import Tokenizer
try:
    ModelConfig.from_dir(sys.argv[1])
    Tokenizer(sys.argv[1])
except ModelFormatError as e:
    print(e)
"""


@pytest.mark.parametrize("file", ["config.json", "tokenizer_config.json", "tokenizer.json", "chat_template.jinja"])
def test_a_fifo_in_place_of_a_file_does_not_hang(folder, file):
    # In a child with a timeout: tokenizers reads tokenizer.json in Rust, where no Python signal can interrupt it.
    (folder / file).unlink()
    os.mkfifo(folder / file)
    out = run_fresh(FIFO_SCRIPT, folder, timeout=120)  # a hang guard, not a timing assertion
    assert out.returncode == 0, out.stderr
    assert "not a regular file" in out.stdout and file in out.stdout


@pytest.mark.parametrize("changes,message", [
    ({"bos_token": 1}, "bos_token must be a token's text"),
    ({"eos_token": {"content": ["</s>"]}}, "eos_token must be a token's text"),
    ({"chat_template": 7}, "chat_template must be text"),
    ({"chat_template": ["{{ x }}"]}, "chat_template must be text or a list of"),
])
def test_tokenizer_config_values_of_the_wrong_type(folder, changes, message):
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(ModelFormatError, match=message):
        Tokenizer(folder)


def test_chat_template_file_not_utf8(folder):
    (folder / "chat_template.jinja").write_bytes(b"{{ bos_token }}\xff")
    with pytest.raises(ModelFormatError, match="chat_template.jinja: not UTF-8"):
        Tokenizer(folder)


def test_generation_config_eos_of_any_type_names_no_token(folder):
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [True, "x", -3, 7, {"a": 1}]}))
    assert ModelConfig.from_dir(folder).eos_token_ids[0] == 7


@pytest.mark.parametrize("value", [7, True, "default", [1]])
def test_gemma3_rope_parameters_of_the_wrong_type(value):
    # found by tests/engine/test_fuzz.py: a TypeError ("argument of type 'int' is not iterable") before
    raw = {"model_type": "gemma3_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "rope_parameters": value}
    with pytest.raises(ModelFormatError, match="rope_parameters must be an object"):
        ModelConfig.from_dict(raw)


def test_a_tokenizer_json_that_panics_in_rust_is_a_format_error(folder):
    # found by tests/engine/test_fuzz.py: tokenizers panics (pyo3's PanicException, a BaseException) on this
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["model"]["continuing_subword_prefix"] = "64"
    tok["model"].pop("byte_fallback", None)
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ModelFormatError, match="tokenizer.json: cannot be read"):
        Tokenizer(folder)


def test_a_huge_layer_count_is_refused_before_anything_is_built_per_layer():
    # found by tests/engine/test_fuzz.py: Mistral's per-layer windows for 10**18 layers raised MemoryError
    raw = {**LLAMA_3_1_8B, "model_type": "mistral", "architectures": ["MistralForCausalLM"], "rope_scaling": None,
           "sliding_window": 4096, "num_hidden_layers": 10**18}
    with pytest.raises(ModelFormatError, match="num_hidden_layers=1000000000000000000 is more than any model has"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("window", [0, -8, 2**64])
def test_sliding_window_out_of_range(window):
    # found by tests/engine/test_fuzz.py: 2**64 reached the attention kernel (OverflowError)
    raw = {**LLAMA_3_1_8B, "model_type": "mistral", "architectures": ["MistralForCausalLM"], "rope_scaling": None,
           "sliding_window": window}
    with pytest.raises(ModelFormatError, match="sliding_window must be a positive integer up to"):
        ModelConfig.from_dict(raw)
