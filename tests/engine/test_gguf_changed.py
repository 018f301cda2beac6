"""A GGUF file (or a part of a split one) replaced or truncated under a loaded model is noticed before its pages
are read, as a safetensors file is (tests/engine/test_weights_changed.py): Engine.check_weights before each step."""

import os

import pytest

gguf = pytest.importorskip("gguf")
from factory import make_model, run_fresh  # noqa: E402
from gguf_factory import write_gguf  # noqa: E402

from stowage.engine.errors import ModelFormatError  # noqa: E402
from stowage.engine.formats.gguf_model import GGUFModel  # noqa: E402


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    # eos_token_id=None: a reply cannot end on its own before the truncation is noticed
    return make_model(tmp_path_factory.mktemp("hf") / "m", "llama", eos_token_id=None)


@pytest.fixture(params=["single", "split"])
def files(request, hf, tmp_path):
    first = write_gguf(hf, tmp_path / "m.gguf", "q8_0", split_max_tensors=7 if request.param == "split" else 0)
    return sorted(tmp_path.glob("*.gguf")) if request.param == "split" else [first]


def weights(path):
    import torch

    return GGUFModel(path).weights(torch.float32, converts=False)


@pytest.mark.parametrize("change", ["truncate", "replace", "rewrite"])
def test_a_changed_file_or_part_is_refused(files, change):
    w = weights(files[0])
    w.check_unchanged()
    path = files[-1]  # the last part: not the one the model was opened by
    if change == "truncate":
        os.truncate(path, 4096)
    elif change == "replace":  # a new download moved into place: another inode
        (path.parent / "new").write_bytes(path.read_bytes())
        os.replace(path.parent / "new", path)
    else:
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(ModelFormatError, match=f"{path.name} changed on disk while the model was loaded.*load the "
                                               "model again"):
        w.check_unchanged()


SCRIPT = r"""
import os, sys
from stowage.engine.runtime.engine import Engine
from stowage.engine.runtime.sampler import SamplingParams
from factory import cpu_plan
engine = Engine.load(sys.argv[1], cpu_plan(sys.argv[1], 256))
generation = engine.generate([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=100))
for i, _ in enumerate(generation):
    if i == 0:  # the weights were read: their pages are mapped
        os.truncate(sys.argv[2], 4096)
print("generated past a truncated file")
"""


def test_generation_stops_cleanly_when_its_gguf_file_is_truncated(files):
    out = run_fresh(SCRIPT, files[0], files[-1], timeout=120)
    # the typed error ends the process (exit status 1), not SIGBUS (-7)
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr[-2000:])
    assert f"WeightsChangedError: the weights file {files[-1].name} changed on disk" in out.stderr
