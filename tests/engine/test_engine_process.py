"""The engine in a child process (engine/process/engine_process.py): real `stowage serve` children on a tiny model,
killed and truncated for real; the caller survives and says how the engine died."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from factory import ROOT, cpu_plan, make_model
from processes import alive

from stowage.engine.runtime.engine import Engine
from stowage.engine.planning.plan import PlanRequest
from stowage.engine.process.engine_process import EngineProcess, describe_exit
from stowage.engine.errors import EngineCrashedError, EngineStartError, GenerationCancelled
from stowage.engine.runtime.sampler import SamplingParams

TIMEOUT = 120
LONG = SamplingParams(temperature=0, max_tokens=900)  # seconds of decoding on this machine: time to kill it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("engine-process") / "model", "llama", initializer_range=0.2)


def first_text(stream):
    """Iterate until some text came; the iterator, to go on with."""
    texts = iter(stream)
    text = ""
    while not text:
        text = next(texts)
    return texts


def test_a_child_answers_as_the_engine_does_and_unloads_to_nothing(model_dir):
    progress = []
    start = time.perf_counter()
    with EngineProcess.start(model_dir, PlanRequest(256), progress=lambda f, m: progress.append((f, m))) as engine:
        started = time.perf_counter() - start
        assert engine.pid != os.getpid() and engine.is_alive
        messages = [{"role": "user", "content": "Stowage plans memory"}]
        stream = engine.chat(messages, SamplingParams(temperature=0, max_tokens=12))
        text = "".join(stream)
        alone = Engine.load(model_dir, cpu_plan(model_dir, 256))
        expected = alone.chat(messages, SamplingParams(temperature=0, max_tokens=12)).run()
        assert text == stream.result.text == expected.text
        assert stream.result.token_ids == expected.token_ids
        assert engine.server.memory()["pid"] == engine.pid
        assert engine.server.plan()["context_tokens"] == 256
        proc = engine.proc
    assert proc.returncode == 0  # POST /stowage/unload: a clean exit
    assert any("layer 3/3 on cpu" in m for _, m in progress) and progress[-1][0] == 1.0
    print(f"child start to /health: {started:.2f} s")


def test_the_key_is_private_and_not_on_the_command_line(model_dir):
    import httpx

    with EngineProcess.start(model_dir, PlanRequest(64)) as engine:
        cmdline = open(f"/proc/{engine.pid}/cmdline", "rb").read().decode()
        key = engine.server._http.headers["Authorization"].removeprefix("Bearer ")
        assert len(key) >= 32 and key not in cmdline
        assert httpx.get(f"{engine.server.base_url}/v1/models").status_code == 401
        assert httpx.get(f"{engine.server.base_url}/health").status_code == 200


@pytest.mark.parametrize("sig, words", [(signal.SIGKILL, "killed by SIGKILL: the system ran out of memory"),
                                        (signal.SIGBUS, "killed by SIGBUS: a weights file changed or was truncated")])
def test_a_killed_child_is_a_typed_error_and_the_text_so_far_is_kept(model_dir, sig, words):
    engine = EngineProcess.start(model_dir, PlanRequest(1024))
    stream = engine.chat([{"role": "user", "content": "Write a long story"}], LONG)
    texts = first_text(stream)
    os.kill(engine.pid, sig)
    with pytest.raises(EngineCrashedError, match=words):
        for _ in texts:
            pass
    assert stream.result.text and stream.result.finish_reason is None
    assert not engine.is_alive
    with pytest.raises(EngineCrashedError, match=words):  # and on the next call
        list(engine.chat([{"role": "user", "content": "Hi"}], LONG))
    engine.close()  # nothing left to end; no error


def test_refusals_are_the_childs_own_one_line_message(model_dir, tmp_path):
    with pytest.raises(EngineStartError, match="config.json"):
        EngineProcess.start(tmp_path, PlanRequest(64))
    with pytest.raises(EngineStartError, match="1,024"):  # past the model's positions
        EngineProcess.start(model_dir, PlanRequest(5000))


def test_cancel_ends_the_child_while_it_loads(model_dir):
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(GenerationCancelled):
        EngineProcess.start(model_dir, PlanRequest(64), cancel=cancel)


def test_the_child_ends_with_its_parent(model_dir):
    code = ("import sys; from stowage.engine.process.engine_process import EngineProcess; "
            "from stowage.engine.planning.plan import PlanRequest; "
            "e = EngineProcess.start(sys.argv[1], PlanRequest(64)); print(e.pid, flush=True); "
            "import time; time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-P", "-c", code, str(model_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()  # no chance to close its engine
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and alive(child):
        time.sleep(0.1)
    assert not alive(child)


def test_deaths_in_words():
    assert describe_exit(-signal.SIGBUS) == ("the engine process was killed by SIGBUS: a weights file changed or "
                                             "was truncated while in use")
    assert describe_exit(-signal.SIGUSR1) == "the engine process was killed by SIGUSR1"
    assert describe_exit(3, "RuntimeError: boom") == "the engine process exited with status 3: RuntimeError: boom"


def test_generate_survives_its_weights_truncated_under_it(tmp_path):
    """Issue 12's scenario: `stowage generate M --chat ... &`, then `truncate -s 4096 M/model.safetensors`."""
    model = make_model(tmp_path / "model", "llama", initializer_range=0.2)
    proc = subprocess.Popen([sys.executable, "-P", "-m", "stowage.engine.cli", "generate", str(model), "--chat", "--prompt",
                             "Write a long story", "--max-tokens", "900"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    first = proc.stdout.read1(64)  # the reply has begun
    assert first, proc.stderr.read().decode()
    os.truncate(model / "model.safetensors", 4096)
    rest, err = proc.communicate(timeout=TIMEOUT)
    err = err.decode()
    assert proc.returncode == 2, err  # the CLI's error status, not 135 (SIGBUS)
    last = err.strip().splitlines()[-1]
    assert last.startswith("stowage: ") and ("changed on disk" in last or "SIGBUS" in last), err
    assert "Traceback" not in err
    print(f"printed {len(first + rest)} bytes; {last}")
