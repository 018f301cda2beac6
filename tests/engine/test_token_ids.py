"""Token ids the embeddings cannot look up, and empty prompts, are typed errors before anything runs (issue 12).

A tokenizer with ids past the embedding's rows passes every check of either file alone; it used to fail at the
first prompt with an IndexError in F.embedding. `inspect` (so `stowage plan`) and `Engine.load` compare the two
(ModelLayout.check_token_ids), the load before the KV cache is allocated.
"""

import json

import pytest
from factory import cpu_plan, make_model

import stowage.engine.runtime.engine as engine_module
from stowage.engine.cli import build_parser
from stowage.engine.runtime.engine import Engine
from stowage.engine.errors import InvalidArgumentError, ModelFormatError
from stowage.engine.planning import inspect
from stowage.engine.cli.plan import EXIT_BAD_MODEL, run_plan
from stowage.engine.runtime.sampler import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("ids"), "llama")  # 512 embedding rows, a 400-token tokenizer


@pytest.fixture(scope="module")
def engine(model_dir):
    loaded = Engine.load(model_dir, cpu_plan(model_dir, 64))
    yield loaded
    loaded.close()


def test_a_tokenizer_larger_than_the_embeddings_is_refused_by_plan_and_load(model_dir, tmp_path, monkeypatch, capsys):
    plan = cpu_plan(model_dir, 64)  # a plan for the same layers and dtype, made before the tokenizer was swapped
    small = make_model(tmp_path, "llama", vocab_size=300)  # the tokenizer has ids up to 399
    with pytest.raises(ModelFormatError) as by_inspect:
        inspect(small)
    message = str(by_inspect.value)
    assert "token ids up to 399" in message and "'model.embed_tokens.weight' has 300 rows" in message
    assert "use the tokenizer files published with the model" in message

    def no_cache(*args, **kwargs):
        raise AssertionError("the KV cache was allocated before the tokenizer was checked")

    monkeypatch.setattr(engine_module, "KVCache", no_cache)
    with pytest.raises(ModelFormatError) as by_load:
        Engine.load(small, plan)
    assert str(by_load.value) == message
    assert run_plan(build_parser().parse_args(["plan", str(small), "--context", "64", "--ram-budget", "8GiB"])) \
        == EXIT_BAD_MODEL
    assert "token ids up to 399" in capsys.readouterr().err


def test_a_post_processor_id_past_the_embeddings_is_counted(model_dir, tmp_path):
    # The BOS that encode() adds has its id in the post-processor, not in the vocabulary.
    folder = tmp_path / "m"
    folder.mkdir()
    for f in model_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["post_processor"]["special_tokens"]["<s>"]["ids"] = [999]
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ModelFormatError, match="token ids up to 999"):
        inspect(folder)


def test_an_empty_prompt_is_an_invalid_argument(engine):
    with pytest.raises(InvalidArgumentError, match="the prompt is empty"):
        engine.generate([], GREEDY)
    with pytest.raises(InvalidArgumentError, match="no messages"):
        engine.chat([], GREEDY)


@pytest.mark.parametrize("bad", [512, 10**12, -1, 2.0, "7", True])
def test_token_ids_the_embeddings_cannot_look_up_are_invalid_arguments(engine, bad):
    with pytest.raises(InvalidArgumentError, match=r"token ids are integers from 0 to 511"):
        engine.generate([1, 2, bad], GREEDY)


def test_the_last_row_is_a_valid_id(engine):
    assert engine.generate([1, 511], GREEDY).run().token_ids
