"""A model split into parts (NAME-00001-of-0000N.gguf, as gguf-split and the converter write them) is the same
model as the single file: the same config, tensors and greedy tokens, from any part or the folder."""

import pytest

gguf = pytest.importorskip("gguf")
from factory import cpu_plan, make_model  # noqa: E402
from gguf_factory import write_gguf  # noqa: E402

from stowage.engine.runtime.engine import Engine  # noqa: E402
from stowage.engine.planning import inspect  # noqa: E402
from stowage.engine.runtime.sampler import SamplingParams  # noqa: E402

PROMPT = "Split files hold the same model; the parts load as one."


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    hf = make_model(root / "hf", "llama", initializer_range=0.2)
    (root / "single").mkdir(), (root / "split").mkdir()
    single = write_gguf(hf, root / "single" / "tiny-q8_0.gguf", "q8_0")
    first = write_gguf(hf, root / "split" / "tiny-q8_0.gguf", "q8_0", split_max_tensors=7)
    return single, sorted(first.parent.glob("*.gguf"))


def greedy(path):
    engine = Engine.load(path, cpu_plan(path, 256))
    ids = engine.tokenizer.encode(PROMPT)
    result = engine.generate(ids, SamplingParams(temperature=0, max_tokens=24)).run()
    engine.close()
    return result.token_ids


def test_a_split_model_gives_the_single_files_greedy_tokens(files):
    single, parts = files
    assert len(parts) >= 3 and parts[0].name == f"tiny-q8_0-00001-of-{len(parts):05d}.gguf"
    assert single.stat().st_size < sum(p.stat().st_size for p in parts)  # every part has its own header
    tokens = greedy(single)
    assert len(tokens) == 24
    for path in (parts[0], parts[-1], parts[0].parent):  # any part, or the folder holding them
        assert greedy(path) == tokens


def test_a_split_model_is_planned_from_all_its_parts(files):
    single, parts = files
    one, split = inspect(single), inspect(parts[1])
    assert split.layer_bytes() == one.layer_bytes() and split.weights_bytes() == one.weights_bytes() > 0
