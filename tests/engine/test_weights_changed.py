"""A weight file replaced or truncated under a loaded model is noticed before its pages are read (issue 12).

Reading a page past the end of a truncated mapping kills the process with SIGBUS; the checkpoint therefore
remembers what each file was (device, inode, size, mtime) when its header was read, and refuses to map or to
keep using a file that has changed. Checkpoint.check_unchanged() is the cheap check to make before each step.
"""

import os

import pytest
from factory import make_model, run_fresh

from stowage.engine.formats.checkpoint import Checkpoint
from stowage.engine.errors import ModelFormatError

NAME = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("changed"), "llama")


@pytest.fixture
def copy(model_dir, tmp_path):
    for f in model_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    return tmp_path


def test_unchanged_files_pass(copy):
    ckpt = Checkpoint(copy)
    ckpt.tensor(NAME)
    ckpt.check_unchanged()


@pytest.mark.parametrize("change", ["truncate", "replace", "rewrite"])
def test_a_changed_file_is_refused_before_it_is_read(copy, change):
    ckpt = Checkpoint(copy)
    ckpt.tensor(NAME)
    path = copy / "model.safetensors"
    if change == "truncate":
        os.truncate(path, 4096)
    elif change == "replace":  # a new download moved into place: another inode
        (copy / "new").write_bytes(path.read_bytes())
        os.replace(copy / "new", path)
    else:
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(ModelFormatError, match="model.safetensors changed on disk while the model was loaded.*load "
                                               "the model again"):
        ckpt.check_unchanged()


def test_a_file_changed_between_header_and_mapping_is_refused(copy):
    ckpt = Checkpoint(copy)
    os.truncate(copy / "model.safetensors", 4096)
    with pytest.raises(ModelFormatError, match="changed on disk"):
        ckpt.tensor(NAME)


SCRIPT = r"""
import os, sys
from stowage.engine.formats.checkpoint import Checkpoint
from stowage.engine.errors import ModelFormatError
ckpt = Checkpoint(sys.argv[1])
t = ckpt.tensor("model.layers.2.mlp.down_proj.weight")  # near the end of the file
os.truncate(os.path.join(sys.argv[1], "model.safetensors"), 4096)
try:
    ckpt.check_unchanged()
except ModelFormatError as e:
    print("refused:", e)
    sys.exit(3)
print(float(t.sum()))  # would be SIGBUS: the pages are gone
"""


def test_in_a_real_process_the_check_comes_before_sigbus(copy):
    out = run_fresh(SCRIPT, copy, timeout=120)
    assert out.returncode == 3, (out.returncode, out.stderr)
    assert "refused:" in out.stdout and "changed on disk" in out.stdout
