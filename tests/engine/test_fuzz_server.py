"""The server's request bodies, fuzzed: no request gets a 5xx but for a model that is gone (issue 31).

A seeded generator writes bodies for POST /v1/chat/completions, /v1/completions and /stowage/load: valid ones
(max_tokens 1-4, so generating is cheap; loads of the two tiny models listed, at small contexts), valid ones
mutated (fields of the wrong type, numbers out of range, NaN and infinities, huge strings and lists, values
nested deep, unknown fields, required ones dropped, lone surrogates in keys and values), and bodies that are
no JSON object at all (empty, garbage bytes, invalid UTF-8, a BOM, JSON nested 100,000 deep, scalars, arrays,
integers of 5,000 digits, a body past the 8 MiB cap); a few with a foreign Host, a foreign Origin, a POST
that is not JSON or a GET, which the guards refuse with 403, 415 and 405. Requests are sequential, on one
in-process app (Starlette's TestClient, as if reached at 127.0.0.1), so a 503 `server_busy` cannot happen.

Every response must be < 500, and so must every error inside a 200's event stream (a load's, a stream's);
the one 5xx allowed is 503 `model_not_loaded`: the model is gone (a load failed after unloading it). An
exception the app raises fails the case with its traceback. The run prints its status counts per endpoint.

The default suite runs DEFAULT_CASES; `make fuzz` (pytest -m fuzz) runs LONG_CASES, or STOWAGE_FUZZ_CASES.
A failure names its case seed: `make_case(seed, model)` rebuilds that request (model: the name served then).
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import struct
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

import pytest
from factory import cpu_plan, make_model
from starlette.testclient import TestClient

from stowage.engine.formats.discovery import Places
from stowage.engine.runtime.engine import Engine
from stowage.engine.server.app import create_app
from stowage.engine.server.schemas import CHAT_FIELDS, COMPLETION_FIELDS, LOAD_FIELDS
from stowage.engine.server.serving import LoadDefaults, Served, Serving
from stowage.engine.serving.scheduler import Scheduler

DEFAULT_CASES = 200
LONG_CASES = 10_000
FIRST_LONG_SEED = 1_000_000  # the long run's seeds do not repeat the default suite's
CASE_SECONDS = 120  # a hang guard: the whole process stops with every thread's traceback
CONTEXT = 128
ALLOWED_5XX = {(503, "model_not_loaded")}  # the model is gone

CHAT, COMPLETIONS, LOAD = "/v1/chat/completions", "/v1/completions", "/stowage/load"

# -- what bodies are made of ---------------------------------------------------------------------------------------

TEXTS = ["Hi", "", "Stowage plans memory", "Überraschung! Café, 東京 🚀", "\u0000", "<|end|>", "<s><|user|>",
         "{{ messages }}", "{% raw %}", "\ud800", "a\udfffb", "\r\n\t", " " * 50, "x" * 600]
ODD_INTS = [0, 1, -1, 2, 3, 4, 16, 127, 128, 129, 399, 400, 1024, 2**31, 2**32 + 1, 2**53 + 1, 2**63, 2**64,
            -(2**63), 10**30]
ODD_FLOATS = [0.0, -0.0, 1e-320, 0.5, 1.0, 1.5, 2.0, 2.0000001, -1.0, 1e308, float("nan"), float("inf"),
              float("-inf")]
ODD_VALUES = [None, True, False, "", "1", "text", [], [1], ["a"], {}, {"a": 1}, {"type": "text"}, "\ud800",
              "😀" * 3]
NEUTRAL = {"n": 1, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "logprobs": False,
           "top_logprobs": 0, "tools": [], "tool_choice": "none", "parallel_tool_calls": True, "functions": [],
           "function_call": "none", "response_format": {"type": "text"}, "echo": False, "suffix": "", "best_of": 1}
RAW_BODIES = [b"", b" ", b"null", b"[]", b"[{}]", b"1", b"-0", b'"{}"', b"true", b"{", b"}", b"{}", b"{,}",
              b'{"a":}', b"{'model': 'x'}", b'{"messages": [}', b"\xef\xbb\xbf{}", b'{"prompt": "\xff\xfe"}',
              b'{"prompt": "a"}\x00', b"NaN", b'{"max_tokens": NaN}', b'{"prompt": "a", "prompt": [1]}',
              b'{"\\ud800": 1}', b'{"prompt": "\\udc00"}', b'{"model": "\\ud83d"}',
              b'{"max_tokens": ' + b"9" * 5000 + b"}", b'{"prompt": "a", "max_tokens": 1e400}']
UNKNOWN_KEYS = ["foo", "", " model", "MODEL", "max_tokens ", "messages\u0000", "\ud800", "__proto__", "x" * 300]
HEADER_VARIANTS = [
    ({"host": "evil.example"}, "foreign Host"),
    ({"host": "localhost.evil.example:8000"}, "foreign Host"),
    ({"origin": "http://evil.example"}, "foreign Origin"),
    ({"origin": "null"}, "foreign Origin"),
    ({"content-type": "text/plain"}, "text/plain"),
    ({"content-type": "application/x-www-form-urlencoded"}, "form"),
    ({"content-type": "multipart/form-data; boundary=x"}, "multipart"),
    ({"content-type": "application/json; charset=utf-8"}, "json; charset"),
    ({"content-type": "APPLICATION/JSON"}, "JSON upper case"),
    ({"content-type": None}, "no Content-Type"),
    ({"origin": "http://127.0.0.1:8000"}, "own Origin"),
    ({"host": "localhost:8000"}, "localhost Host"),
]


@dataclass
class Case:
    seed: int
    endpoint: str
    kind: str  # valid, mutated, raw, headers, method
    content: bytes
    headers: dict = field(default_factory=lambda: {"content-type": "application/json"})
    method: str = "POST"

    def describe(self) -> str:
        shown = self.content[:400] + (b"..." if len(self.content) > 400 else b"")
        return (f"seed {self.seed}: {self.method} {self.endpoint} ({self.kind}), headers {self.headers}, "
                f"{len(self.content):,} bytes: {shown!r}")


def dumps(body) -> bytes:
    # ensure_ascii: a lone surrogate is written as its \\udXXX escape, as a client's JSON library would
    return json.dumps(body, allow_nan=True).encode()


def odd_value(rng: random.Random):
    pick = rng.random()
    if pick < 0.3:
        return rng.choice(ODD_INTS)
    if pick < 0.5:
        return rng.choice(ODD_FLOATS)
    if pick < 0.8:
        return rng.choice(ODD_VALUES)
    if pick < 0.9:
        return rng.choice(TEXTS)
    return huge_value(rng)


def huge_value(rng: random.Random):
    return rng.choice([
        lambda: "y" * rng.choice([1_000, 100_000, 1_000_000]),
        lambda: [rng.randrange(400) for _ in range(rng.choice([200, 10_000]))],
        lambda: ["stop"] * rng.choice([5, 1_000]),
        lambda: {f"k{i}": i for i in range(rng.choice([100, 10_000]))},
        lambda: nested(rng.choice([10, 100, 900])),
        lambda: [{"role": "user", "content": "Hi"}] * rng.choice([50, 2_000]),
    ])()


def nested(depth: int):
    value: object = 1
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


def sampling_fields(rng: random.Random, body: dict) -> None:
    """A few of the sampling fields, each in its valid range."""
    choices = {
        "temperature": lambda: rng.choice([0, 0.0, 0.7, 1, 2, rng.uniform(0, 2)]),
        "top_p": lambda: rng.choice([1, 0.9, rng.uniform(1e-6, 1)]),
        "top_k": lambda: rng.choice([-1, 0, 1, 5, 1000]),
        "min_p": lambda: rng.choice([0, 0.05, 1, rng.random()]),
        "repetition_penalty": lambda: rng.choice([1, 1.1, 0.5, 100]),
        "seed": lambda: rng.choice([0, 1, 2**64 - 1, rng.randrange(2**32)]),
        "stop": lambda: rng.choice(["\n", "", ["a", "b"], [], ["<|end|>"] * 4, "z" * 512]),
        "user": lambda: rng.choice(["", "u-1", "\u00e9"]),
    }
    for key in rng.sample(sorted(choices), rng.randrange(len(choices) + 1)):
        body[key] = choices[key]()
    for key in rng.sample(sorted(NEUTRAL), rng.randrange(3)):
        body[key] = NEUTRAL[key]
    if rng.random() < 0.3:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": rng.random() < 0.5}
    elif rng.random() < 0.2:
        body["stream"] = False


def valid_chat(rng: random.Random, model: str | None) -> dict:
    def content():
        if rng.random() < 0.2:
            return [{"type": "text", "text": rng.choice(TEXTS[:9])} for _ in range(rng.randint(1, 3))]
        return rng.choice(TEXTS[:9])

    messages = [{"role": rng.choice(["system", "user", "assistant"]), "content": content()}
                for _ in range(rng.randint(1, 3))]
    body = {"messages": messages}
    body[rng.choice(["max_tokens", "max_completion_tokens"])] = rng.randint(1, 4)
    if model is not None and rng.random() < 0.5:
        body["model"] = model
    sampling_fields(rng, body)
    return body


def valid_completion(rng: random.Random, model: str | None) -> dict:
    if rng.random() < 0.4:
        prompt = [rng.randrange(400) for _ in range(rng.randint(1, 20))]
    else:
        prompt = rng.choice(TEXTS[:9])
        prompt = [prompt] if rng.random() < 0.1 else prompt
    body = {"prompt": prompt, "max_tokens": rng.randint(1, 4)}
    if model is not None and rng.random() < 0.5:
        body["model"] = model
    sampling_fields(rng, body)
    return body


def valid_load(rng: random.Random, model: str | None) -> dict:
    body = {"model": rng.choice(["alpha", "beta"])}
    if rng.random() < 0.8:
        body["context_tokens"] = rng.choice([32, 64, CONTEXT, 256])
    if rng.random() < 0.5:
        body["parallel"] = rng.choice([1, 2])
    if rng.random() < 0.3:
        body["dtype"] = rng.choice(["float32", "bfloat16", "float16"])
    if rng.random() < 0.3:
        body["kv_dtype"] = rng.choice(["float32", "bfloat16", "float16", "fp8"])
    return body


VALID = {CHAT: valid_chat, COMPLETIONS: valid_completion, LOAD: valid_load}
FIELDS = {CHAT: sorted(CHAT_FIELDS), COMPLETIONS: sorted(COMPLETION_FIELDS), LOAD: sorted(LOAD_FIELDS)}


def mutate(rng: random.Random, body: dict, endpoint: str) -> dict:
    """body with one to three mutations."""
    for _ in range(rng.randint(1, 3)):
        pick = rng.random()
        if pick < 0.45:  # a field the endpoint knows, set to an odd value
            body[rng.choice(FIELDS[endpoint])] = odd_value(rng)
        elif pick < 0.55:  # a field it does not know
            body[rng.choice(UNKNOWN_KEYS)] = odd_value(rng)
        elif pick < 0.65 and body:  # a field dropped
            del body[rng.choice(sorted(body))]
        elif pick < 0.85 and endpoint == CHAT and isinstance(body.get("messages"), list) and body["messages"]:
            messages = body["messages"]
            i = rng.randrange(len(messages))
            if isinstance(messages[i], dict) and rng.random() < 0.8:
                key = rng.choice(["role", "content", "content", "name", "tool_calls", "audio", "images",
                                  rng.choice(UNKNOWN_KEYS)])
                messages[i][key] = rng.choice([odd_value(rng), [{"type": "image_url", "image_url": {"url": "x"}}],
                                               [{"type": "text", "text": odd_value(rng)}], "tool", "developer"])
            else:
                messages[i] = odd_value(rng)
        elif pick < 0.85 and endpoint == COMPLETIONS:
            body["prompt"] = rng.choice([[rng.choice(ODD_INTS)] * rng.randint(1, 3), [[1, 2]], ["a", "b"],
                                         [1.0, 2.0], [True], [-1], [400], [399] * 200, odd_value(rng)])
        elif pick < 0.85 and endpoint == LOAD:
            body["model"] = rng.choice(["", "../alpha", "/etc/passwd", "alpha/../beta", "ALPHA", "empty.gguf",
                                        "empty", "missing", "alpha\u0000", "\ud800", "a" * 10_000, odd_value(rng)])
        else:  # a number just out of its range
            key = rng.choice(["max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                              "context_tokens", "parallel"])
            body[key] = rng.choice([0, -1, 0.0, 2.5, 1e-9, 10**12, 2**64, 2**64 - 1, -(2**64), 3.0, 1.0, 4.5])
    return body


def raw_body(rng: random.Random) -> bytes:
    pick = rng.random()
    if pick < 0.5:
        return rng.choice(RAW_BODIES)
    if pick < 0.65:
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    if pick < 0.8:
        depth = rng.choice([100, 1_000, 10_000, 100_000])
        opener, closer = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
        return opener * depth + b"1" + closer * depth
    if pick < 0.95:
        return dumps(rng.choice([None, 1, -1.5, "text", [], [1, 2], [{"prompt": "a"}], True, "\ud800"]))
    if pick < 0.99:  # a valid body cut short
        text = dumps({"messages": [{"role": "user", "content": "Hi"}], "prompt": "Hi", "model": "alpha"})
        return text[:rng.randrange(len(text))]
    return b'{"prompt": "' + b"a" * (8 * 1024 * 1024 + 1) + b'"}'  # past MAX_BODY_BYTES: 413


def make_case(seed: int, model: str | None) -> Case:
    """The request of case `seed`, against a server that serves `model` (None: none)."""
    rng = random.Random(seed)
    endpoint = rng.choices([CHAT, COMPLETIONS, LOAD], weights=[40, 40, 20])[0]
    pick = rng.random()
    if endpoint == LOAD and pick < 0.35 and rng.random() < 0.6:  # a real load is costly: fewer of them
        pick = 0.35 + rng.random() * 0.65
    if pick < 0.35:
        return Case(seed, endpoint, "valid", dumps(VALID[endpoint](rng, model)))
    if pick < 0.80:
        return Case(seed, endpoint, "mutated", dumps(mutate(rng, VALID[endpoint](rng, model), endpoint)))
    if pick < 0.94:
        return Case(seed, endpoint, "raw", raw_body(rng))
    if pick < 0.98:
        extra, what = rng.choice(HEADER_VARIANTS)
        headers = {"content-type": "application/json", **extra}
        body = VALID[endpoint](rng, model) if endpoint != LOAD else {"model": "missing"}
        return Case(seed, endpoint, f"headers: {what}", dumps(body),
                    {k: v for k, v in headers.items() if v is not None})
    return Case(seed, endpoint, "method", b"", {}, rng.choice(["GET", "PUT", "DELETE", "PATCH"]))


# -- the server, and one case against it ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-server") / "models"
    make_model(root / "alpha", "llama", initializer_range=0.2, seed=0)
    make_model(root / "beta", "llama", initializer_range=0.2, seed=1)
    (root / "empty.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))  # listed, not loadable: a 400
    return root


@pytest.fixture(scope="module")
def server(models):
    """A TestClient (reached as at 127.0.0.1, so the Host check runs) on a Serving of alpha that may load what
    `models` holds; and the Serving."""
    engine = Engine.load(models / "alpha", cpu_plan(models / "alpha", CONTEXT))
    serving = Serving(Served("alpha", Scheduler(engine, max_running=2, max_waiting=4).start()),
                      LoadDefaults(Places(stowage_models=models), parallel=1, max_queue=4))
    yield TestClient(create_app(serving), base_url="http://127.0.0.1:8000"), serving
    serving.close()


def stream_errors(response) -> list[dict]:
    """The error objects sent inside a 200's event stream."""
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        return []
    errors = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[len("data: "):])
            if isinstance(event, dict) and "error" in event:
                errors.append(event["error"])
    return errors


def status_of(error: dict) -> int:
    """An in-stream error's HTTP status, as the server would have sent it: server_error is a 5xx."""
    return 500 if error.get("type") == "server_error" else 400


def run_case(client: TestClient, case: Case) -> tuple[str, str | None]:
    """(what the case got, for the counts; a failure's description or None)."""
    faulthandler.dump_traceback_later(CASE_SECONDS, exit=True)
    try:
        response = client.request(case.method, case.endpoint, content=case.content, headers=case.headers)
    except Exception:
        return "exception", f"{case.describe()}\nraised in the app:\n{traceback.format_exc()}"
    finally:
        faulthandler.cancel_dump_traceback_later()
    status, code = response.status_code, None
    if response.headers.get("content-type", "").startswith("application/json"):
        try:
            code = (response.json().get("error") or {}).get("code")
        except (ValueError, AttributeError):
            pass
    got = str(status) if code is None else f"{status} {code}"
    if status >= 500 and (status, code) not in ALLOWED_5XX:
        return got, f"{case.describe()}\ngot {status}: {response.text[:2000]}"
    for error in stream_errors(response):
        got = f"{status} + stream error {error.get('code') or error.get('type')}"
        if status_of(error) >= 500:
            return got, f"{case.describe()}\ngot {status} with an error in its stream: {error}"
    return got, None


def fuzz(client: TestClient, serving: Serving, seeds: range) -> None:
    counts: dict[str, Counter] = {CHAT: Counter(), COMPLETIONS: Counter(), LOAD: Counter()}
    kinds: Counter = Counter()
    failures = []
    started = time.perf_counter()
    for seed in seeds:
        current = serving.current.name if serving.current is not None else None
        case = make_case(seed, current)
        got, failure = run_case(client, case)
        counts[case.endpoint][got] += 1
        kinds[case.kind.partition(":")[0]] += 1
        if failure is not None:
            failures.append(failure)
    seconds = time.perf_counter() - started
    print(f"\nserver fuzz: {len(seeds):,} cases (seeds {seeds.start}-{seeds.stop - 1}) in {seconds:.1f} s; "
          f"kinds {dict(sorted(kinds.items()))}")
    for endpoint, counter in counts.items():
        print(f"  {endpoint} ({sum(counter.values()):,}): "
              + ", ".join(f"{k}: {v:,}" for k, v in sorted(counter.items())))
    print(f"  5xx other than a model that is gone: {len(failures)}")
    assert not failures, f"{len(failures)} case(s) got a 5xx:\n\n" + "\n\n".join(failures[:10])


def test_server_bodies_get_no_5xx(server):
    client, serving = server
    fuzz(client, serving, range(DEFAULT_CASES))


@pytest.mark.fuzz
def test_server_bodies_get_no_5xx_long(server, request):
    if "fuzz" not in (request.config.option.markexpr or ""):
        pytest.skip("the long fuzz runs with `make fuzz` (pytest -m fuzz)")
    client, serving = server
    cases = int(os.environ.get("STOWAGE_FUZZ_CASES", LONG_CASES))
    fuzz(client, serving, range(FIRST_LONG_SEED, FIRST_LONG_SEED + cases))
