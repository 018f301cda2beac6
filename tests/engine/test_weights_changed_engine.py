"""A weight file truncated while the engine generates stops the generation with a typed error, not SIGBUS: between
steps (the check before each step) and during one (kernels/fault_guard.py: the step reads zeros, the check after it
discards its results)."""

from factory import make_model, run_fresh

SCRIPT = r"""
import os, sys
from stowage.engine.runtime.engine import Engine
from stowage.engine.errors import ModelFormatError
from stowage.engine.runtime.sampler import SamplingParams
from factory import cpu_plan
model_dir = sys.argv[1]
engine = Engine.load(model_dir, cpu_plan(model_dir, 256))
events = iter(engine.generate([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=100)))
try:
    next(events)  # the weights were read: their pages are mapped
    os.truncate(os.path.join(model_dir, "model.safetensors"), 4096)
    for _ in events:
        pass
except ModelFormatError as e:
    print("stopped:", e)
    sys.exit(3)
print("generated past a truncated file")
"""


def test_generation_stops_cleanly_when_its_weights_file_is_truncated(tmp_path):
    # eos_token_id=None: the reply cannot end on its own before the truncation is noticed
    model_dir = make_model(tmp_path / "m", "llama", eos_token_id=None)
    out = run_fresh(SCRIPT, model_dir, timeout=120)
    assert out.returncode == 3, (out.returncode, out.stdout, out.stderr[-2000:])
    assert "model.safetensors changed on disk while the model was loaded" in out.stdout


MID_STEP = r"""
import os, sys
from stowage.engine.runtime.engine import Engine
from stowage.engine.errors import WeightsChangedError
from stowage.engine.runtime.sampler import SamplingParams
from factory import cpu_plan
model_dir = sys.argv[1]
engine = Engine.load(model_dir, cpu_plan(model_dir, 256))
model, calls = engine.model, []
decode_step = model.decode_step

def truncating_step(*args):
    calls.append(1)
    if len(calls) == 3:  # after the check before this step: the step itself meets the missing pages
        os.truncate(os.path.join(model_dir, "model.safetensors"), 4096)
    return decode_step(*args)

model.decode_step = truncating_step
tokens = 0
try:
    for event in engine.generate([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=50)):
        tokens += 1
except WeightsChangedError as e:
    print(f"stopped after {tokens} tokens:", e)
    sys.exit(3)
print("generated past a truncated file")
"""


def test_a_file_truncated_during_a_step_is_a_typed_error_not_sigbus(tmp_path):
    # before the fault guard: the process died with SIGBUS (-7) inside the step, with no message
    model_dir = make_model(tmp_path / "m", "llama", eos_token_id=None)
    out = run_fresh(MID_STEP, model_dir, timeout=120)
    assert out.returncode == 3, (out.returncode, out.stdout, out.stderr[-2000:])
    assert out.stdout.startswith("stopped after ")
    assert "the weights file model.safetensors changed on disk while the model was loaded" in out.stdout


FOREIGN_SIGBUS = r"""
import faulthandler, os, signal, sys, numpy as np
from stowage.kernels import fault_guard
path = sys.argv[1]
first = fault_guard.watch(np.memmap(path, dtype=np.uint8, mode="r"))
faulthandler.enable()  # takes SIGBUS over, keeping the guard as the handler before it
second = fault_guard.watch(np.memmap(path, dtype=np.uint8, mode="r"))  # the guard takes it back
assert first.slot is not None and second.slot is not None
os.kill(os.getpid(), signal.SIGBUS)
print("survived a foreign SIGBUS")
"""


def test_a_sigbus_not_the_guards_reaches_faulthandler_once_then_ends_the_process(tmp_path):
    # before: the guard and faulthandler handed it to each other: four dumps, then SIGSEGV (exit 139)
    path = tmp_path / "w.bin"
    path.write_bytes(b"x" * 8192)
    out = run_fresh(FOREIGN_SIGBUS, path, timeout=120)
    assert out.returncode == -7, (out.returncode, out.stderr[-2000:])  # SIGBUS, as without the guard
    assert out.stderr.count("Fatal Python error: Bus error") == 1, out.stderr[-2000:]
    assert "survived" not in out.stdout
