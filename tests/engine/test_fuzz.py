"""Mutated model folders: inspect, plan, load and a first reply raise only Stowage's own errors, never hang (issue 12).

A seeded generator mutates a tiny model's files (Llama, Qwen2, Qwen3, Gemma 3, windowed Mistral, a sharded Llama; Llama as GGUF in Q8_0 and F16): safetensors headers (bytes, length, offsets, dtypes,
shapes, names) and data, shard indexes, config.json, tokenizer_config.json and generation_config.json.
Each case runs `inspect` -> `check` (plan) -> `Engine.load` -> a two-token chat reply and must end in
success or a StowageError, within CASE_SECONDS, and the run must not grow the process's peak memory past
MAX_GROWTH_BYTES (the plan's RAM budget is 2 GiB, so nothing planned can be large either).

The default suite runs DEFAULT_CASES; `make fuzz` (pytest -m fuzz) runs LONG_CASES, or STOWAGE_FUZZ_CASES.
A failure names its case seed: `fuzz_case(seed)` rebuilds exactly that mutation.
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import resource
import shutil
import signal
import struct
import time
import traceback
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from factory import make_model

from stowage.engine.dtypes import SAFETENSORS
from stowage.engine.runtime.engine import Engine
from stowage.engine.errors import StowageError, StowageWarning
from stowage.engine.planning import PlanRequest, check, inspect
from stowage.engine.planning.budgets import given_budgets
from stowage.engine.runtime.sampler import SamplingParams
from stowage.engine.units import GiB, MiB

DEFAULT_CASES = 500
LONG_CASES = 10_000
CASE_SECONDS = 20  # a hang guard: a normal case takes ~50 ms
MAX_GROWTH_BYTES = 512 * MiB
BUDGETS = given_budgets([], 2 * GiB)
INDEX = "model.safetensors.index.json"


class CaseHung(Exception):
    """A case ran past CASE_SECONDS (not a StowageError: it fails the run)."""


@contextmanager
def time_limit(seconds: float):
    def hung(*_):
        raise CaseHung(f"no result after {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    # A hang in native code (the Rust tokenizer, a blocking syscall that retries) never returns to Python to
    # run the handler: then the whole run stops with every thread's traceback, instead of waiting forever.
    faulthandler.dump_traceback_later(3 * seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- the values mutations draw from ------------------------------------------------------------------------------

ODD_INTS = [0, 1, 2, 3, -1, -2, 7, 63, 64, 65, 127, 128, 511, 512, 513, 4096, 2**31, 2**32 + 1, 2**53 + 1, 2**63,
            2**64 + 3, 10**18, -(2**63)]
ODD_FLOATS = [0.0, -0.0, 0.5, 1.5, -1.0, 1e-320, 1e-6, 1e308, float("nan"), float("inf"), float("-inf")]
ODD_VALUES = [None, True, False, "", "64", "llama", [], [1], [64, 64], {}, {"a": 1}, "\u0000", "😀" * 3]
TEMPLATES = ["", "{{", "{% for m in messages %}{{ m['content'] }}", "{{ messages[0]['content'] * 1000 }}",
             "{% for i in range(10**9) %}x{% endfor %}", "{{ bos_token }}{{ undefined.x }}", "{% raw %}",
             "{{ messages | tojson }}", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "{{ 'a' * 10**9 }}"]


def odd_value(rng: random.Random):
    pool = rng.choice([ODD_INTS, ODD_FLOATS, ODD_VALUES])
    return rng.choice(pool)


def whole_file(rng: random.Random, valid: bytes) -> bytes:
    """A file that is not a JSON object, or not JSON, or not text."""
    return rng.choice([
        b"", b"null", b"[]", b"[1, 2]", b"4096", b'"text"', b"true", b"{", b"\xff\xfe\x00{", b"\xef\xbb\xbf{}",
        valid[: rng.randrange(len(valid) + 1)], valid + b"garbage", b"[" * 200_000,
        bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))),
        valid.replace(b'"', b"'", 1), valid.replace(b":", b":" + b"\xff", 1),
    ])


def mutate_json(rng: random.Random, obj: dict, keys: list[str]) -> dict:
    """Set, scale, drop or retype one to three keys of a JSON object."""
    obj = dict(obj)
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(keys + list(obj)) if obj else rng.choice(keys)
        action = rng.random()
        if action < 0.25:
            obj.pop(key, None)
        elif action < 0.5 and isinstance(obj.get(key), (int, float)) and not isinstance(obj.get(key), bool):
            value = obj[key]
            obj[key] = rng.choice([value * 2, value // 2 if isinstance(value, int) else value / 2, value + 1,
                                   value - 1, -value, value * 1000])
        else:
            obj[key] = odd_value(rng)
    return obj


# -- safetensors -------------------------------------------------------------------------------------------------

def split_file(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join_file(header, body: bytes, length_delta: int = 0) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", max(0, len(raw) + length_delta)) + raw + body


def relaid(header: dict, body: bytes, rng: random.Random) -> bytes:
    """The tensors laid out again in order for their (possibly new) dtypes and shapes: a header that is consistent."""
    out, offset, new_body = {}, 0, bytearray()
    for name, e in header.items():
        if name == "__metadata__":
            out[name] = e
            continue
        numel = 1
        for d in e["shape"]:
            numel *= d
        nbytes = numel * SAFETENSORS[e["dtype"]][0]
        if nbytes > 4 * MiB:
            nbytes = 0  # keep the file small: such a tensor will not match its offsets
        begin, end = (o if type(o) is int else 0 for o in e["data_offsets"])
        chunk = body[begin:end][:nbytes]
        new_body += chunk + (bytes(nbytes - len(chunk)) if rng.random() < 0.5 else os.urandom(nbytes - len(chunk)))
        out[name] = {**e, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    return join_file(out, bytes(new_body))


SAME_SIZE = {"F32": ["I32"], "I32": ["F32"], "BF16": ["F16", "I16"], "F16": ["BF16", "I16"], "I16": ["BF16"]}


def mutate_entry(rng: random.Random, entry, names: list[str]) -> object:
    if not isinstance(entry, dict):
        return odd_value(rng)
    entry = dict(entry)
    shape = entry.get("shape")
    shape = list(shape) if isinstance(shape, list) else []
    choice = rng.randrange(9)
    if choice == 0:  # a dtype of the same size (the header stays consistent), or any other code
        dtype = entry.get("dtype")
        entry["dtype"] = rng.choice(SAME_SIZE.get(dtype if isinstance(dtype, str) else "", ["F32"])
                                    + [rng.choice(list(SAFETENSORS))])
    elif choice == 1:
        entry["dtype"] = odd_value(rng)
    elif choice == 2 and len(shape) == 2:  # same element count, other shape: transposed or flattened
        entry["shape"] = rng.choice([shape[::-1], [shape[0] * shape[1]], [shape[0], 1, shape[1]]])
    elif choice == 3 and shape:
        i = rng.randrange(len(shape))
        if type(shape[i]) is not int:
            shape[i] = 1
        shape[i] = rng.choice([shape[i] + 1, shape[i] - 1, shape[i] * 2, shape[i] // 2, 0, rng.choice(ODD_INTS)])
        entry["shape"] = shape
    elif choice == 4:
        entry["shape"] = odd_value(rng)
    elif choice == 5:
        offsets = entry.get("data_offsets")
        begin, end = offsets if isinstance(offsets, list) and len(offsets) == 2 and all(
            type(o) is int for o in offsets) else (0, 0)
        delta = rng.choice([1, -1, 2, 4, -4, 8, 4096, 2**40])
        entry["data_offsets"] = rng.choice([[begin + delta, end + delta], [begin, end + delta], [end, begin],
                                            [begin + delta, end], [rng.choice(ODD_INTS), rng.choice(ODD_INTS)]])
    elif choice == 6:
        entry["data_offsets"] = odd_value(rng)
    elif choice == 7:
        entry.pop(rng.choice(["dtype", "shape", "data_offsets"]), None)
    else:
        entry[rng.choice(["extra", "dtype"])] = odd_value(rng)
    return entry


def mutate_header(rng: random.Random, header: dict) -> tuple[dict | object, bool]:
    """A mutated header, and whether the body must be laid out again to match it."""
    names = [n for n in header if n != "__metadata__"]
    header = dict(header)
    relayout = False
    for _ in range(rng.randint(1, 3)):
        choice = rng.randrange(10)
        name = rng.choice(names)
        if choice <= 3:
            header[name] = mutate_entry(rng, header[name], names)
            relayout = relayout or rng.random() < 0.5
        elif choice == 4:  # rename: another layer, another role, nonsense
            new = rng.choice([name.replace("layers.0.", "layers.99."), name.replace("q_proj", "k_proj"),
                              name.replace("weight", "bias"), "", "model.layers.-1.x", rng.choice(names) + "x",
                              "model.layers.1" + "0" * 30 + ".mlp.up_proj.weight"])
            header[new] = header.pop(name)
        elif choice == 5:
            a, b = rng.sample(names, 2)
            header[a], header[b] = header[b], header[a]
        elif choice == 6:
            header.pop(name, None)
        elif choice == 7:
            header[name + ".alias"] = header[name]  # two names, one span: they overlap
        elif choice == 8:
            header["__metadata__"] = odd_value(rng)
        else:
            return odd_value(rng), False
        names = [n for n in header if n != "__metadata__"] or ["x"]
        if not isinstance(header.get(names[0], {}), (dict, type(None))) and rng.random() < 0.3:
            break
    return header, relayout


def mutate_safetensors(rng: random.Random, data: bytes) -> bytes:
    header, body = split_file(data)
    (n,) = struct.unpack("<Q", data[:8])
    choice = rng.randrange(10)
    if choice == 0:  # flip bytes in the length or the header text
        out = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(min(len(out), 8 + n))
            out[i] = rng.randrange(256)
        return bytes(out)
    if choice == 1:  # the length field
        value = rng.choice([0, 1, 7, n - 1, n + 1, n + 8, len(data), len(data) - 8, 100 * MiB + 1, 2**63, 2**64 - 1,
                            rng.randrange(2**64)])
        return struct.pack("<Q", value) + data[8:]
    if choice == 2:  # truncated anywhere, or with bytes after the end
        return rng.choice([data[: rng.randrange(len(data))], data + os.urandom(rng.randrange(1, 4096))])
    if choice == 3:  # bytes inserted or cut inside the header text
        i = rng.randrange(8, 8 + n)
        return rng.choice([data[:i] + os.urandom(rng.randint(1, 16)) + data[i:], data[:i] + data[i + rng.randint(1, 16):]])
    if choice == 4:  # the data itself: NaN, inf and random bits in the weights
        out = bytearray(data)
        start = 8 + n + rng.randrange(max(1, len(body)))
        span = rng.choice([4, 64, 4096, len(body)])
        fill = rng.choice([b"\xff\xff\xff\x7f", b"\x00\x00\x80\x7f", b"\x80\x7f", None])
        chunk = os.urandom(span) if fill is None else (fill * (span // len(fill) + 1))[:span]
        out[start : start + span] = chunk[: max(0, len(out) - start)]
        return bytes(out[: len(data)])
    mutated, relayout = mutate_header(rng, header)
    if relayout and isinstance(mutated, dict) and all(
            isinstance(e, dict) and isinstance(e.get("dtype"), str) and e["dtype"] in SAFETENSORS
            and isinstance(e.get("shape"), list)
            and all(type(d) is int and 0 <= d < 2**20 for d in e["shape"])
            and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
            for k, e in mutated.items() if k != "__metadata__"):
        return relaid(mutated, body, rng)
    return join_file(mutated, body, rng.choice([0, 0, 0, 8, -8, 1]))


# -- GGUF --------------------------------------------------------------------------------------------------------

def mutate_gguf(rng: random.Random, data: bytes) -> bytes:
    """Bytes of the header, the metadata and the tensor infos (the first part of the file), or its length."""
    out = bytearray(data)
    front = min(len(out), 24 + rng.choice([64, 1024, 16384, len(out)]))
    choice = rng.randrange(5)
    if choice == 0:  # flipped bytes
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(front)] = rng.randrange(256)
    elif choice == 1:  # a count, a length, a type id or an offset overwritten (u32 or u64, little-endian)
        for _ in range(rng.randint(1, 3)):
            width = rng.choice([4, 8])
            at = rng.randrange(0, max(1, front - width), width)
            value = rng.choice(ODD_INTS + [rng.randrange(2**32)]) % 2**(8 * width)
            out[at : at + width] = value.to_bytes(width, "little")
    elif choice == 2:
        return data[: rng.randrange(len(data))]
    elif choice == 3:  # bytes inserted or cut in the metadata: every field after it shifts
        at = rng.randrange(24, front)
        return rng.choice([data[:at] + os.urandom(rng.randint(1, 9)) + data[at:], data[:at] + data[at + rng.randint(1, 9):]])
    else:  # the data: NaN and random bits in the weights
        at = rng.randrange(len(out) // 2, len(out))
        span = min(len(out) - at, rng.choice([2, 34, 4096]))
        out[at : at + span] = rng.choice([os.urandom(span), b"\xff" * span])
    return bytes(out)


# -- the model folder's other files ------------------------------------------------------------------------------

CONFIG_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
               "tie_word_embeddings", "attention_bias", "mlp_bias", "model_type", "architectures", "eos_token_id",
               "bos_token_id", "rope_scaling", "rope_parameters", "torch_dtype", "dtype", "sliding_window",
               "use_sliding_window", "max_window_layers", "layer_types", "sliding_window_pattern",
               "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping", "rope_local_base_freq",
               "hidden_activation", "hidden_act"]
ROPES = [None, {}, [], "llama3", {"rope_type": "llama3"}, {"type": "linear", "factor": 2.0},
         {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64},
         {"rope_type": "llama3", "factor": float("nan"), "low_freq_factor": 4.0, "high_freq_factor": 1.0},
         {"rope_type": "default", "rope_theta": -1.0}, {"rope_theta": 500000.0}, {"rope_type": ["llama3"]},
         {"full_attention": {"rope_type": "default"}}, {"rope_type": "yarn", "factor": 4.0}]


def mutate_config(rng: random.Random, data: bytes) -> bytes:
    if rng.random() < 0.2:
        return whole_file(rng, data)
    config = mutate_json(rng, json.loads(data), CONFIG_KEYS)
    if rng.random() < 0.3:
        config[rng.choice(["rope_scaling", "rope_parameters"])] = rng.choice(ROPES)
    return json.dumps(config).encode()


def mutate_tokenizer_config(rng: random.Random, data: bytes) -> bytes:
    if rng.random() < 0.3:
        return whole_file(rng, data)
    config = mutate_json(rng, json.loads(data), ["bos_token", "eos_token", "chat_template", "added_tokens_decoder"])
    if rng.random() < 0.4:
        config["chat_template"] = rng.choice(TEMPLATES + [[{"name": "default", "template": rng.choice(TEMPLATES)}],
                                                          [{"name": 1}], [3], {"default": "x"}])
    if rng.random() < 0.3:
        config[rng.choice(["bos_token", "eos_token"])] = rng.choice(
            [{"content": odd_value(rng)}, {"content": "<s>"}, odd_value(rng), "<|end|>", "not a token"])
    return json.dumps(config).encode()


def mutate_generation_config(rng: random.Random, data: bytes) -> bytes:
    if rng.random() < 0.3:
        return whole_file(rng, data)
    return json.dumps(mutate_json(rng, json.loads(data), ["eos_token_id", "bos_token_id"])).encode()


def mutate_tokenizer_json(rng: random.Random, data: bytes) -> bytes:
    if rng.random() < 0.3:
        return whole_file(rng, data)
    tok = json.loads(data)
    part = rng.choice(["model", "added_tokens", "pre_tokenizer", "decoder", "post_processor", "normalizer"])
    if rng.random() < 0.5 or not isinstance(tok.get(part), dict):
        tok[part] = odd_value(rng)
    else:
        tok[part] = mutate_json(rng, tok[part], ["type", "vocab", "merges", "single", "special_tokens"])
    return json.dumps(tok).encode()


def mutate_template_file(rng: random.Random, data: bytes) -> bytes:
    return rng.choice([rng.choice(TEMPLATES).encode(), data[: rng.randrange(len(data) + 1)], data + b"\xff",
                       b"\xef\xbb\xbf" + data, data.replace(b"{{", b"{", 1)])


def mutate_index(rng: random.Random, data: bytes, shards: list[str]) -> bytes:
    if rng.random() < 0.25:
        return whole_file(rng, data)
    index = json.loads(data)
    weight_map = dict(index["weight_map"])
    choice = rng.randrange(6)
    if choice == 0:
        index["weight_map"] = odd_value(rng)
        return json.dumps(index).encode()
    if choice == 1:
        index.pop("weight_map")
        return json.dumps(index).encode()
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(list(weight_map))
        weight_map[name] = rng.choice([
            "../" + shards[0], "/" + shards[0], "/etc/passwd", "sub/../" + shards[0], "./" + shards[0], "",
            ".", "..", "missing.safetensors", shards[0] + "\u0000", "config.json", "tokenizer.json",
            rng.choice(shards), odd_value(rng), "a\\..\\" + shards[0], "/dev/zero",
        ])
        if choice == 5:
            weight_map.pop(name, None)
    index["weight_map"] = weight_map
    return json.dumps(index).encode()


# -- one case ----------------------------------------------------------------------------------------------------

@dataclass
class Base:
    """A valid tiny model folder and what can be mutated in it."""

    folder: Path
    shards: list[str] = field(default_factory=list)
    gguf: str | None = None  # the GGUF file, for a GGUF model (the folder holds nothing else)


@dataclass
class Case:
    seed: int
    base: str
    changes: list[str]  # "file: how"


def fuzz_case(seed: int, bases: dict[str, Base], case_dir: Path) -> Case:
    """Lay out the case of `seed` in case_dir: every base file linked, the mutated ones written anew."""
    rng = random.Random(seed)
    name = rng.choice(sorted(bases))
    base = bases[name]
    case_dir.mkdir(parents=True)
    for f in base.folder.iterdir():
        os.link(f, case_dir / f.name)
    weights = {"weights": 6, "config.json": 4, "tokenizer_config.json": 2, "generation_config.json": 1,
               "tokenizer.json": 1, "chat_template.jinja": 1}
    if base.shards:
        weights[INDEX] = 4
    chosen = []
    for _ in range(0 if base.gguf else rng.choice([1, 1, 1, 2])):  # one file, sometimes two different ones
        left = [t for t in weights if t not in chosen]
        chosen.append(rng.choices(left, [weights[t] for t in left])[0])
    changes = []
    if base.gguf:
        path = case_dir / base.gguf
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(mutate_gguf(rng, data))
        changes.append(f"{base.gguf}: {len(data)} -> {path.stat().st_size} bytes")
    for target in chosen:
        if target == "weights":
            target = rng.choice(base.shards or ["model.safetensors"])
        path = case_dir / target
        if not path.exists():  # chat_template.jinja, removed by a tokenizer_config.json mutation
            continue
        data = path.read_bytes()
        if target.endswith(".safetensors"):
            new = mutate_safetensors(rng, data)
        elif target == "config.json":
            new = mutate_config(rng, data)
        elif target == "tokenizer_config.json":
            new = mutate_tokenizer_config(rng, data)
            if rng.random() < 0.5:
                (case_dir / "chat_template.jinja").unlink(missing_ok=True)  # let tokenizer_config's template count
        elif target == "generation_config.json":
            new = mutate_generation_config(rng, data)
        elif target == "tokenizer.json":
            new = mutate_tokenizer_json(rng, data)
        elif target == "chat_template.jinja":
            new = mutate_template_file(rng, data)
        else:
            new = mutate_index(rng, data, base.shards)
        path.unlink()  # a link to the base: write a new file, never through the link
        path.write_bytes(new)
        changes.append(f"{target}: {len(data)} -> {len(new)} bytes")
    return Case(seed, name, changes)


def run_case(case_dir: Path) -> str:
    """'ok', or the name of the StowageError the case ended in; anything else propagates."""
    engine = None
    try:
        with time_limit(CASE_SECONDS), warnings.catch_warnings():
            warnings.simplefilter("ignore", StowageWarning)  # e.g. "no chat template": told, not refused
            info = inspect(case_dir)
            plan = check(info, PlanRequest(32), BUDGETS)
            engine = Engine.load(case_dir, plan)
            engine.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=2)).run()
        return "ok"
    except StowageError as e:
        return type(e).__name__
    finally:
        if engine is not None:
            engine.close()


@dataclass
class Figures:
    cases: int = 0
    seconds: float = 0.0
    outcomes: Counter = field(default_factory=Counter)
    failures: list[tuple[str, str]] = field(default_factory=list)  # (exception type, "seed N (base; changes): ...")
    peak_growth_bytes: int = 0


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def fuzz(bases: dict[str, Base], root: Path, num_cases: int, first_seed: int = 0) -> Figures:
    figures, peak_before, start = Figures(), peak_rss_bytes(), time.perf_counter()
    for seed in range(first_seed, first_seed + num_cases):
        case_dir = root / f"case-{seed}"
        case = fuzz_case(seed, bases, case_dir)
        try:
            figures.outcomes[run_case(case_dir)] += 1
        except BaseException as e:  # noqa: BLE001 - anything but a StowageError is the finding
            if isinstance(e, KeyboardInterrupt):
                raise
            figures.outcomes[type(e).__name__] += 1
            figures.failures.append((type(e).__name__, f"seed {seed} ({case.base}; {', '.join(case.changes)}): "
                                     + "".join(traceback.format_exception_only(e)).strip()
                                     + "\n" + "".join(traceback.format_tb(e.__traceback__)[-3:])))
        shutil.rmtree(case_dir, ignore_errors=True)
        figures.cases += 1
    figures.seconds = time.perf_counter() - start
    figures.peak_growth_bytes = peak_rss_bytes() - peak_before
    return figures


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Base]:
    import torch
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("fuzz-bases")
    small = dict(vocab_size=448, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    out = {
        "llama": Base(make_model(root / "llama", "llama", **small)),
        "qwen2": Base(make_model(root / "qwen2", "qwen2", dtype=torch.bfloat16, **small)),
        "qwen3-tied": Base(make_model(root / "qwen3", "qwen3", dtype=torch.bfloat16, head_dim=16,
                                      tie_word_embeddings=True, **small)),
        "gemma3": Base(make_model(root / "gemma3", "gemma3_text", head_dim=16, query_pre_attn_scalar=24,
                                  sliding_window=8, sliding_window_pattern=2, **small)),
        "mistral-window": Base(make_model(root / "mistral", "mistral", sliding_window=8, **small)),
    }
    sharded = make_model(root / "sharded", "llama", **small)
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names, shards, weight_map = sorted(tensors), ["model-00001-of-00002.safetensors",
                                                  "model-00002-of-00002.safetensors"], {}
    for shard, keys in zip(shards, (names[: len(names) // 2], names[len(names) // 2 :])):
        save_file({k: tensors[k] for k in keys}, sharded / shard, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(keys, shard)
    (sharded / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out["llama-sharded"] = Base(sharded, shards)
    from gguf_factory import write_gguf

    for qtype in ("q8_0", "f16"):
        folder = root / f"gguf-{qtype}"
        folder.mkdir()
        write_gguf(out["llama"].folder, folder / f"tiny-{qtype}.gguf", qtype)
        out[f"llama-gguf-{qtype}"] = Base(folder, gguf=f"tiny-{qtype}.gguf")
    for base in out.values():  # every base is valid: a failure below is the mutation's
        assert run_case(base.folder) == "ok"
    return out


def check_figures(figures: Figures) -> None:
    first_of_each = {}
    for kind, text in figures.failures:
        first_of_each.setdefault(kind, text)
    assert not figures.failures, f"{len(figures.failures)} of {figures.cases} cases raised something other than a " \
        "StowageError; the first of each kind:\n\n" + "\n\n".join(first_of_each.values())
    assert figures.peak_growth_bytes < MAX_GROWTH_BYTES, f"peak memory grew by {figures.peak_growth_bytes:,} bytes"
    assert figures.outcomes["ok"] > 0 and len(figures.outcomes) > 3  # the mutations reach both sides of the checks


def test_mutated_model_folders_raise_only_stowage_errors(bases, tmp_path):
    check_figures(fuzz(bases, tmp_path, DEFAULT_CASES))


@pytest.mark.fuzz
def test_long_fuzz(bases, tmp_path, request):
    if "fuzz" not in (request.config.option.markexpr or ""):
        pytest.skip("the long fuzz runs with `make fuzz` (pytest -m fuzz)")
    num_cases = int(os.environ.get("STOWAGE_FUZZ_CASES", LONG_CASES))
    figures = fuzz(bases, tmp_path, num_cases, first_seed=DEFAULT_CASES)  # past the default suite's seeds
    print(f"\nfuzz: {figures.cases} cases in {figures.seconds:.0f} s; outcomes {dict(figures.outcomes.most_common())}; "
          f"peak memory growth {figures.peak_growth_bytes / MiB:.0f} MiB")
    check_figures(figures)
