"""Limits on what a hostile request, model folder or command line can make the engine do (issue 31,
docs/robustness.md "Hostile sizes"): each case is bounded with a typed error, or costs time linear in its size."""

import io
import json
import os
import time
from contextlib import redirect_stderr

import pytest
from factory import make_model

from stowage.engine.errors import InvalidArgumentError, ModelFormatError
from stowage.engine.formats.config import ModelConfig

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


# -- model files ----------------------------------------------------------------------------------


def test_a_long_eos_token_id_list_is_refused_at_once():
    # de-duplicating 200,000 ids pairwise took minutes; 20,000 took seconds before this was refused
    raw = LLAMA | {"eos_token_id": list(range(20_000))}
    start = time.perf_counter()
    with pytest.raises(ModelFormatError, match=r"config.json: eos_token_id lists 20,000 ids; at most \d+"):
        ModelConfig.from_dict(raw)
    with pytest.raises(ModelFormatError, match=r"generation_config.json: eos_token_id lists 20,000 ids"):
        ModelConfig.from_dict(LLAMA, {"eos_token_id": list(range(20_000))})
    assert time.perf_counter() - start < 1.0


def test_eos_token_ids_are_merged_in_order_without_repeats():
    config = ModelConfig.from_dict(LLAMA | {"eos_token_id": [2, 7, 2, 9]}, {"eos_token_id": [9, 3, 3]})
    assert config.eos_token_ids == (9, 3, 2, 7)


def test_an_oversized_tokenizer_json_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    from stowage.engine.text import tokenizer

    model = make_model(tmp_path / "m", "llama")
    parsed = []

    class Parser:  # what parses tokenizer.json: never reached
        def __getattr__(self, name):
            parsed.append(name)

    monkeypatch.setattr(tokenizer, "_HFTokenizer", Parser())
    path = model / "tokenizer.json"
    with open(path, "r+b") as f:
        f.truncate(65 * 1024 * 1024)  # sparse: the size is all that matters
    with pytest.raises(ModelFormatError, match=r"tokenizer.json: 68,157,440 bytes; at most [\d,]+ bytes"):
        tokenizer.Tokenizer(model)
    assert parsed == []


# -- the command line -----------------------------------------------------------------------------


def run_cli(*argv) -> tuple[int, str]:
    from stowage.engine.cli import main

    err = io.StringIO()
    with redirect_stderr(err):
        code = main(list(argv))
    return code, err.getvalue()


def test_threads_past_four_times_the_cores_are_refused(tmp_path, monkeypatch):
    from stowage.kernels import cpu_decode

    monkeypatch.delenv(cpu_decode.THREADS_ENV, raising=False)
    most = cpu_decode.max_threads()
    assert most == 4 * cpu_decode.num_cores()
    code, err = run_cli("generate", str(tmp_path), "--prompt", "x", "--threads", "100000")
    assert code == 2
    assert err.strip() == (f"stowage: --threads 100,000 is more than 4x the {cpu_decode.num_cores()} cores this "
                           f"process may use; give at most {most} (default: {cpu_decode.num_cores()})")
    assert cpu_decode.THREADS_ENV not in os.environ
    # the variable the app and the CLI pass to the engine's process is held to the same bound
    monkeypatch.setenv(cpu_decode.THREADS_ENV, "100000")
    assert cpu_decode.default_threads() == most


@pytest.mark.parametrize("url", ["http://[::1", "http://host:99999", "http://host:port", "ftp://host", "host:8080",
                                 "http://"])
def test_a_malformed_remote_url_is_one_line(url):
    from stowage.engine.process.client import RemoteServer

    with pytest.raises(InvalidArgumentError, match="not a server URL"):
        RemoteServer(url)
    code, err = run_cli("chat", "--remote", url)
    assert code == 2 and err.count("\n") == 2 and "Traceback" not in err  # "\nstowage: ...\n"


# -- listing models -------------------------------------------------------------------------------


def test_a_gguf_file_is_read_once_for_every_listing_while_it_is_unchanged(tmp_path, monkeypatch):
    gguf = pytest.importorskip("gguf")
    from stowage.engine.formats import discovery

    folder = tmp_path / "models"
    folder.mkdir()
    writer = gguf.GGUFWriter(str(folder / "tiny-Q8_0.gguf"), "llama")
    writer.add_file_type(7)  # Q8_0
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reads = []
    from stowage.engine.formats import gguf as gguf_reader  # discovery imports it when a listing first needs it

    read_metadata = gguf_reader.read_metadata
    monkeypatch.setattr(gguf_reader, "read_metadata", lambda *a: reads.append(a) or read_metadata(*a))
    places = discovery.Places(stowage_models=folder)
    first = discovery.discover(places)
    assert [(m.name, m.quant) for m in first.models] == [("tiny-Q8_0", "Q8_0")]
    assert discovery.discover(places) == first and len(reads) == 1
    path = folder / "tiny-Q8_0.gguf"
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten: read again
    assert discovery.discover(places) == first and len(reads) == 2
    json.dumps(discovery.to_dict(first))
