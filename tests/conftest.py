import sys
from pathlib import Path

import torch

# tests/support/factory.py builds the tiny models every test package uses; tests of the benchmarks and the
# measured-memory tests import bench/'s modules. The code under test is the installed `stowage` package: the
# repository root is never on sys.path (--import-mode=importlib).
sys.path.insert(0, str(Path(__file__).parent / "support"))
sys.path.insert(1, str(Path(__file__).parents[1] / "bench"))
# Tiny models: one thread is faster than two (no fork/join per op) and immune to a busy machine.
torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def kv_store_in_a_temp_folder(tmp_path_factory):
    """Servers the tests start (in-process and as children) spill evicted K/V here, never to the user's cache."""
    import os

    folder = tmp_path_factory.mktemp("kv-store")
    previous = os.environ.get("STOWAGE_KV_DIR")
    os.environ["STOWAGE_KV_DIR"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("STOWAGE_KV_DIR", None)
    else:
        os.environ["STOWAGE_KV_DIR"] = previous


@pytest.fixture(autouse=True, scope="session")
def tokenizer_cache_in_a_temp_folder(tmp_path_factory):
    """GGUF tokenizers the tests build (in-process and in children) are cached here, never in the user's cache."""
    import os

    previous = os.environ.get("STOWAGE_TOKENIZER_DIR")
    os.environ["STOWAGE_TOKENIZER_DIR"] = str(tmp_path_factory.mktemp("tokenizers"))
    yield
    if previous is None:
        os.environ.pop("STOWAGE_TOKENIZER_DIR", None)
    else:
        os.environ["STOWAGE_TOKENIZER_DIR"] = previous
