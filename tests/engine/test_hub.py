"""engine/hub against tests/support/hub_server.py: the real huggingface_hub over real HTTP on 127.0.0.1.

Search and listings, the fit verdict from headers alone (equal to the plan of the downloaded file), downloads
into the Hugging Face cache (resumed, hash-checked), and the Hub's errors as sentences."""

from __future__ import annotations

import threading

import pytest
from factory import make_model
from gguf_factory import write_gguf
from hub_server import HubServer, Repo

from stowage.engine.errors import DownloadCancelled, HubAccessError, HubError
from stowage.engine.formats.discovery import Places, discover
from stowage.engine.formats.gguf import GGUFFile
from stowage.engine.hub import download, header
from stowage.engine.hub.client import Hub
from stowage.engine.hub.download import pull
from stowage.engine.hub.header import HeaderReader
from stowage.engine.hub.verdict import verdict
from stowage.engine.planning.budgets import given_budgets
from stowage.engine.planning.inspect import inspect
from stowage.engine.planning.plan import PlanRequest, plan
from stowage.engine.units import GiB

TOKEN = "hf_test_token"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama as safetensors, as one GGUF file in two quantizations, and as a split GGUF."""
    root = tmp_path_factory.mktemp("hub-models")
    st = make_model(root / "st", "llama")
    gguf_dir = root / "gguf"
    gguf_dir.mkdir()
    q8 = write_gguf(st, gguf_dir / "Tiny-Q8_0.gguf", "q8_0")
    f16 = write_gguf(st, gguf_dir / "Tiny-F16.gguf", "f16")
    split_dir = root / "split"
    split_dir.mkdir()
    first = write_gguf(st, split_dir / "Tiny-Q8_0.gguf", "q8_0", split_max_tensors=16)
    parts = sorted(split_dir.glob("*.gguf"))
    assert first == parts[0] and len(parts) >= 2
    return {"st": st, "q8": q8, "f16": f16, "parts": parts}


@pytest.fixture
def server(models, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(header, "FIRST_READ_BYTES", 16 << 10)  # a tiny model's header is a few KiB
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))  # never the login of whoever runs the tests
    with HubServer(tokens={TOKEN}) as hub:
        hub.add(Repo("acme/Tiny-GGUF", {"Tiny-Q8_0.gguf": models["q8"], "Tiny-F16.gguf": models["f16"],
                                        "mmproj-Tiny-F16.gguf": models["f16"], "README.md": b"# Tiny\n"},
                     tags=("gguf", "llama", "text-generation"), gguf_architecture="llama", downloads=50,
                     branches=("v2",)))
        hub.add(Repo("acme/Tiny", {p.name: p for p in models["st"].iterdir()},
                     tags=("transformers", "safetensors", "llama"), model_type="llama", downloads=40,
                     safetensors_parameters={"F32": 200_000}))
        hub.add(Repo("acme/Tiny-split-GGUF", {p.name: p for p in models["parts"]}, tags=("gguf", "llama"),
                     gguf_architecture="llama", downloads=30))
        hub.add(Repo("acme/Tiny-gated", {"Tiny-Q8_0.gguf": models["q8"]}, tags=("gguf", "llama"),
                     gguf_architecture="llama", gated="manual", downloads=20))
        hub.add(Repo("acme/Tiny-bert", {"model.safetensors": b"x"}, tags=("safetensors", "bert"), model_type="bert",
                     downloads=60))
        hub.add(Repo("acme/Tiny-notes", {"notes.txt": b"no weights"}, tags=("text",), downloads=70))
        yield hub


def listed(tmp_path) -> list[str]:
    return [m.name for m in discover(Places(hf_cache=tmp_path / "hf-cache")).models]


# -- asking ------------------------------------------------------------------------------------------


def test_search_keeps_repositories_stowage_runs(server):
    hits = Hub(server.url).search("tiny")
    assert [h.repo for h in hits] == ["acme/Tiny-GGUF", "acme/Tiny", "acme/Tiny-split-GGUF", "acme/Tiny-gated"]
    assert hits[0].formats == ("gguf",) and hits[1].formats == ("safetensors",) and hits[3].gated
    assert Hub(server.url).search("nothing like it") == []
    server.add(Repo("acme/Tiny-bare-GGUF", {"x.gguf": b"GGUF"}, tags=("gguf",), downloads=1))  # no architecture said
    assert Hub(server.url).search("tiny")[-1].repo == "acme/Tiny-bare-GGUF"


def test_hf_endpoint_is_honoured(server, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    assert Hub().endpoint == server.url
    assert Hub().search("split")[0].repo == "acme/Tiny-split-GGUF"


def test_files_are_grouped_by_quantization_with_sizes(server, models):
    files = Hub(server.url).files("acme/Tiny-GGUF")
    assert [(m.name, m.quant) for m in files.models] == [("Tiny-Q8_0.gguf", "Q8_0"), ("Tiny-F16.gguf", "F16")]
    assert files.models[0].size_bytes == models["q8"].stat().st_size  # the projector is not a model
    split = Hub(server.url).files("acme/Tiny-split-GGUF").models
    assert len(split) == 1 and [f.path for f in split[0].weights] == [p.name for p in models["parts"]]
    st = Hub(server.url).files("acme/Tiny").models
    assert [(m.name, m.quant) for m in st] == [("safetensors", "F32")]
    assert {"config.json", "tokenizer.json"} <= {f.path for f in st[0].extras}
    server.add(Repo("acme/Tiny-mistral", {p.name: p for p in models["st"].iterdir()}
                    | {"consolidated.safetensors": b"x" * 64}, tags=("safetensors", "mistral")))
    assert [f.path for f in Hub(server.url).files("acme/Tiny-mistral").models[0].weights] == ["model.safetensors"]
    assert files.find(quant="q8_0").name == "Tiny-Q8_0.gguf"
    with pytest.raises(HubError, match="choose one with --file or --quant: Tiny-Q8_0.gguf"):
        files.find()
    with pytest.raises(HubError, match="no Q4_K_M model; it offers"):
        files.find(quant="Q4_K_M")


def test_sizes_and_hashes_come_from_the_tree_where_the_info_lacks_them(server):
    with_blobs = Hub(server.url).files("acme/Tiny")
    server.info_blobs = False
    assert Hub(server.url).files("acme/Tiny") == with_blobs
    assert any(p.startswith("/api/models/acme/Tiny/tree/") for _, p, _, _ in server.requests)


def test_missing_repository_and_file_are_sentences(server):
    hub = Hub(server.url)
    with pytest.raises(HubError, match="no repository 'acme/None'.*hf auth login"):
        hub.files("acme/None")  # 401 to an anonymous request
    with pytest.raises(HubError, match="no repository 'acme/None' on http://127.0.0.1:[0-9]+; check the name"):
        Hub(server.url, token=TOKEN).files("acme/None")  # 404 to a logged-in one
    model = hub.files("acme/Tiny-GGUF").models[0]
    gone = type(model)(model.repo, model.revision, "Gone.gguf", "gguf", None,
                       (type(model.weights[0])("Gone.gguf", 10, "0" * 64, None),))
    with pytest.raises(HubError, match="acme/Tiny-GGUF has no file 'Gone.gguf'"):
        pull(hub, gone)


def test_gated_repository_says_how_to_log_in(server, tmp_path):
    files = Hub(server.url).files("acme/Tiny-gated")
    assert "gated" in files.gated_note and "hf auth login" in files.gated_note
    with pytest.raises(HubAccessError, match=f"accept its conditions at {server.url}/acme/Tiny-gated"):
        pull(Hub(server.url), files.models[0])
    with pytest.raises(HubAccessError, match="hf auth login"):
        HeaderReader(Hub(server.url)).model_info(files.models[0])
    path = pull(Hub(server.url, token=TOKEN), files.models[0])  # with a token that has access
    assert inspect(path).num_layers == 3


def test_hf_token_is_sent(server, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    model = Hub(server.url).files("acme/Tiny-gated").models[0]
    assert HeaderReader(Hub(server.url)).model_info(model).num_layers == 3
    assert all(auth for method, path, _, auth in server.requests if "/resolve/" in path)


# -- the verdict -------------------------------------------------------------------------------------


@pytest.mark.parametrize("repo", ["acme/Tiny-GGUF", "acme/Tiny", "acme/Tiny-split-GGUF"])
def test_verdict_is_the_plan_of_the_downloaded_file(server, repo):
    hub = Hub(server.url)
    model = hub.files(repo).models[0]
    reader = HeaderReader(hub)
    remote = reader.model_info(model)
    weights = sum(f.size for f in model.weights)
    assert reader.bytes_read < weights  # headers (and config.json) only
    path = pull(hub, model)
    local = inspect(path)
    request = PlanRequest(768, kv_dtype="fp8")
    full_gpu = plan(local, request, given_budgets([4 * GiB], 8 * GiB, gpu_safety_bytes=0)).devices[0].total_bytes
    for budgets in (given_budgets([4 * GiB], 8 * GiB, gpu_safety_bytes=0),  # every layer on the GPU
                    given_budgets([full_gpu - 1], 8 * GiB, gpu_safety_bytes=0),  # one layer short
                    given_budgets([], 8 * GiB),  # no GPU
                    given_budgets([], 30 << 20)):  # not even in RAM
        expected = plan(local, request, budgets)
        v = verdict(reader, model, request, budgets)
        assert v.plan == expected  # the same bytes on every device, the same largest context
        assert [d.total_bytes for d in v.plan.devices] == [d.total_bytes for d in expected.devices]
        assert v.plan.max_context_tokens == expected.max_context_tokens
    partial = verdict(reader, model, request, given_budgets([full_gpu - 1], 8 * GiB, gpu_safety_bytes=0))
    assert partial.fits and partial.text.startswith("fits: 2 of 3 layers on the GPU at 768 tokens")
    assert "largest context 1,024 tokens" in partial.text
    short = verdict(reader, model, request, given_budgets([], 30 << 20))
    assert not short.fits and short.text.startswith("does not fit: ")


def test_gguf_header_range_grows_until_it_parses(server, monkeypatch):
    monkeypatch.setattr(header, "FIRST_READ_BYTES", 256)
    hub = Hub(server.url)
    model = hub.files("acme/Tiny-GGUF").models[0]
    reader = HeaderReader(hub)
    info = reader.model_info(model)
    ranges = [r for method, path, r, _ in server.requests if path.startswith("/cdn-lfs/")]
    assert ranges[0] == "bytes=0-255" and len(ranges) >= 3  # grown, not the whole file at once
    assert reader.bytes_read < model.size_bytes / 2
    assert info.num_layers == 3
    before = len(server.requests)
    assert reader.model_info(model) is info  # cached per file content: no request
    assert len(server.requests) == before


@pytest.mark.parametrize("repo", ["acme/Tiny-GGUF", "acme/Tiny"])
def test_headers_kept_on_disk_are_not_read_again(server, tmp_path, repo):
    hub = Hub(server.url)
    model = hub.files(repo).models[0]
    first = HeaderReader(hub, tmp_path / "headers").model_info(model)
    before = len(server.requests)
    again = HeaderReader(hub, tmp_path / "headers").model_info(model)  # a later process
    assert len(server.requests) == before
    request, budgets = PlanRequest(512), given_budgets([], 8 * GiB)
    assert plan(again, request, budgets) == plan(first, request, budgets)
    for kept in (tmp_path / "headers").iterdir():  # a kept header cut short on disk is read again, not an error
        kept.write_bytes(kept.read_bytes()[:20])
    cut = HeaderReader(hub, tmp_path / "headers").model_info(model)
    assert plan(cut, request, budgets) == plan(first, request, budgets)


def test_a_header_that_is_not_a_model_is_a_verdict_not_an_exception(server):
    server.add(Repo("acme/Broken-GGUF", {"Broken-Q8_0.gguf": b"GGUF" + b"\x07\x00\x00\x00" + bytes(64)},
                    tags=("gguf", "llama"), gguf_architecture="llama"))
    hub = Hub(server.url)
    v = verdict(HeaderReader(hub), hub.files("acme/Broken-GGUF").models[0], PlanRequest(256), given_budgets([], GiB))
    assert v.plan is None and v.text.startswith("cannot plan: Broken-Q8_0.gguf: GGUF version 7")


# -- downloads ---------------------------------------------------------------------------------------


def test_pull_resumes_after_a_dropped_connection(server, tmp_path, models):
    server.drop_after["Tiny-Q8_0.gguf"] = 50_000
    hub = Hub(server.url)
    model = hub.files("acme/Tiny-GGUF").find(quant="Q8_0")
    seen = []
    path = pull(hub, model, progress=seen.append)
    assert path.read_bytes() == models["q8"].read_bytes()
    gets = [r for method, p, r, _ in server.requests if method == "GET" and p.startswith("/cdn-lfs/")]
    assert gets == [None, "bytes=50000-"]  # the second asked only for the rest
    assert seen[-1].done_bytes == seen[-1].total_bytes == model.size_bytes
    assert listed(tmp_path) == ["acme/Tiny-GGUF/Tiny-Q8_0"]


def test_pull_files_the_branch_asked_for_and_no_ref_for_a_commit(server, tmp_path):
    # before: every pull wrote refs/main, so pulling a branch pointed `main` at the branch's files
    hub = Hub(server.url)
    model = hub.files("acme/Tiny-GGUF", revision="v2").find(quant="Q8_0")
    refs = tmp_path / "hf-cache" / "models--acme--Tiny-GGUF" / "refs"
    path = pull(hub, model, ref="v2")
    assert (refs / "v2").read_text() == model.revision and not (refs / "main").exists()
    assert path.parent.name == model.revision
    pull(hub, model, ref=model.revision)
    pull(hub, model, ref="../../escape")
    assert sorted(p.name for p in refs.iterdir()) == ["v2"]
    assert not (tmp_path / "escape").exists()


def test_a_request_one_file_cannot_take_is_that_files_verdict_not_an_error(server):
    # before: plan() ran outside the try, so a q4_0 KV cache on a head_dim-16 model raised and ended the listing
    hub = Hub(server.url)
    model = hub.files("acme/Tiny-GGUF").find(quant="Q8_0")
    v = verdict(HeaderReader(hub), model, PlanRequest(512, kv_dtype="q4_0"), given_budgets([], 8 * GiB))
    assert v.plan is None and v.text.startswith("cannot plan: a q4_0 KV cache needs head_dim")


def test_two_pulls_of_one_file_at_once_fetch_it_once(server, tmp_path, models):
    # before: both appended to the same .incomplete file, and the mixed bytes failed the hash check
    server.slow["Tiny-F16.gguf"] = 0.002
    hub = Hub(server.url)
    model = hub.files("acme/Tiny-GGUF").find(quant="F16")
    paths, errors = [], []

    def one():
        try:
            paths.append(pull(hub, model))
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(paths) == 2
    assert paths[0].read_bytes() == models["f16"].read_bytes()
    gets = [r for method, p, r, _ in server.requests if method == "GET" and p.startswith("/cdn-lfs/")]
    assert gets == [None]  # the second waited for the first, then found the blob


def test_a_hub_that_sends_paths_for_hashes_writes_nothing_outside_the_cache(server, tmp_path, models):
    # before: a server's ETag "../../x" became the blob's path, and a listed "../x.gguf" the snapshot's
    server.add(Repo("acme/Evil", {"../../../../evil-Q8_0.gguf": models["q8"], "ok-Q8_0.gguf": models["q8"]},
                    tags=("gguf", "llama"), gguf_architecture="llama"))
    hub = Hub(server.url)
    assert [m.name for m in hub.files("acme/Evil").models] == ["ok-Q8_0.gguf"]
    server.etag_override = "../../../../planted"
    with pytest.raises(HubError, match="not a hash; refusing"):
        pull(hub, hub.files("acme/Tiny-GGUF").find(quant="Q8_0"))
    assert not list(tmp_path.rglob("planted*")) and not list(tmp_path.rglob("evil*"))


def test_a_cancelled_pull_resumes_where_it_stopped_and_is_never_listed(server, tmp_path, models):
    server.slow["Tiny-F16.gguf"] = 0.02  # 16 KiB at a time: the cancel lands while bytes are still coming
    hub = Hub(server.url)
    model = hub.files("acme/Tiny-GGUF").find(quant="F16")
    cancel = threading.Event()

    def progress(p):
        if p.done_bytes >= 50_000:
            cancel.set()

    with pytest.raises(DownloadCancelled, match="pull again to resume"):
        pull(hub, model, progress=progress, cancel=cancel)
    partials = list((tmp_path / "hf-cache").glob("models--acme--Tiny-GGUF/blobs/*.incomplete"))
    assert len(partials) == 1 and 0 < partials[0].stat().st_size < model.size_bytes
    assert listed(tmp_path) == []  # a partial file is never a model
    done = partials[0].stat().st_size
    path = pull(hub, model)  # a later run (a restart) resumes from the partial file
    assert path.read_bytes() == models["f16"].read_bytes()
    last_get = [r for method, p, r, _ in server.requests if method == "GET" and p.startswith("/cdn-lfs/")][-1]
    assert last_get == f"bytes={done}-"
    assert not list((tmp_path / "hf-cache").glob("**/*.incomplete"))


def test_a_corrupt_download_is_discarded_with_a_clear_message(server, tmp_path):
    server.corrupt.add("Tiny-Q8_0.gguf")
    hub = Hub(server.url)
    model = hub.files("acme/Tiny-GGUF").find(quant="Q8_0")
    with pytest.raises(HubError, match="SHA-256 is [0-9a-f]{64}, but the Hub lists .*discarded"):
        pull(hub, model)
    cache = tmp_path / "hf-cache" / "models--acme--Tiny-GGUF"
    assert not list(cache.glob("blobs/*")) and not list(cache.glob("snapshots/*/*"))
    assert listed(tmp_path) == []
    server.corrupt.clear()
    assert pull(hub, model).is_file()  # the next pull starts again, and is checked again


def test_a_corrupt_small_file_is_caught_by_its_git_blob_id(server, tmp_path):
    server.corrupt.add("config.json")
    hub = Hub(server.url)
    with pytest.raises(HubError, match="acme/Tiny/config.json: the downloaded file's git blob id is"):
        pull(hub, hub.files("acme/Tiny").models[0])
    assert listed(tmp_path) == []  # the weights came first; without config.json the folder is not a model


def test_a_split_gguf_is_fetched_whole_and_opens(server, models, tmp_path):
    hub = Hub(server.url)
    model = hub.files("acme/Tiny-split-GGUF").models[0]
    path = pull(hub, model)
    assert path.name == models["parts"][0].name
    assert sorted(p.name for p in path.parent.iterdir()) == [p.name for p in models["parts"]]
    assert inspect(path).num_layers == 3


def test_a_safetensors_model_opens_from_the_cache(server, tmp_path):
    hub = Hub(server.url)
    path = pull(hub, hub.files("acme/Tiny").models[0])
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    assert "acme/Tiny" in listed(tmp_path)
    before = len(server.requests)
    assert pull(hub, hub.files("acme/Tiny").models[0]) == path  # already there: nothing downloaded again
    assert not [p for method, p, _, _ in server.requests[before:] if method == "GET" and "/resolve/" in p]


def test_free_disk_is_checked_before_the_first_byte(server, monkeypatch):
    monkeypatch.setattr(download, "MIN_FREE_BYTES", 1 << 60)
    hub = Hub(server.url)
    with pytest.raises(HubError, match="not enough disk space: the download needs .* HF_HUB_CACHE"):
        pull(hub, hub.files("acme/Tiny-GGUF").find(quant="Q8_0"))
    assert not [p for method, p, _, _ in server.requests if method == "GET" and p.startswith("/cdn-lfs/")]


def test_an_endpoint_that_is_not_a_hub_is_a_sentence(server):
    # (an unreachable one is too, after huggingface_hub's retries: ~23 s of backoff, too slow for a test)
    with pytest.raises(HubError, match="was not found on http://127.0.0.1:[0-9]+/elsewhere \\(HTTP 404\\)"):
        Hub(server.url + "/elsewhere").search("tiny")


def test_real_size_headers_verdicts_equal_local_plans(server, tmp_path, monkeypatch):
    """A 40k-token vocabulary's GGUF header (3.7 MB: the range grows from 1 MiB, twice) and a sharded safetensors
    model; data regions are holes. The file served is the file planned locally, byte for byte."""
    from gguf_factory import write_sparse_gguf
    from sparse_models import QWEN2_5_7B, write_sparse_model

    monkeypatch.setattr(header, "FIRST_READ_BYTES", 1 << 20)
    gguf_path = tmp_path / "Big-vocab-Q4_K_M.gguf"
    write_sparse_gguf(gguf_path, {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 40000,
                                  "max_position_embeddings": 8192}, {}, default="q4_k")
    st_dir = write_sparse_model(tmp_path / "sharded", {**QWEN2_5_7B, "hidden_size": 512, "intermediate_size": 1024,
                                                       "num_hidden_layers": 6, "num_attention_heads": 8,
                                                       "num_key_value_heads": 2, "vocab_size": 32000}, num_shards=3)
    server.add(Repo("acme/Big-vocab-GGUF", {gguf_path.name: gguf_path}, tags=("gguf", "llama")))
    server.add(Repo("acme/Sharded", {p.name: p for p in st_dir.iterdir()}, tags=("safetensors", "qwen2")))
    hub = Hub(server.url)
    request = PlanRequest(4096, kv_dtype="fp8")
    for repo, local_path in (("acme/Big-vocab-GGUF", gguf_path), ("acme/Sharded", st_dir)):
        reader = HeaderReader(hub)
        model = hub.files(repo).models[0]
        local = inspect(local_path)
        full_gpu = plan(local, request, given_budgets([64 * GiB], 64 * GiB, gpu_safety_bytes=0)).devices[0].total_bytes
        for budgets in (given_budgets([full_gpu - 1], 8 * GiB, gpu_safety_bytes=0), given_budgets([], 8 * GiB)):
            assert verdict(reader, model, request, budgets).plan == plan(local, request, budgets)
        headers = GGUFFile(local_path).data_start if repo.endswith("GGUF") else sum(f.size for f in model.weights) / 8
        assert reader.bytes_read <= 2 * headers  # the headers (a range at most twice as long as needed), no data
    ranges = [r for _, p, r, _ in server.requests if p.startswith("/cdn-lfs/") and r and r.startswith("bytes=")]
    assert ranges[:3] == ["bytes=0-1048575", "bytes=1048576-2097151", "bytes=2097152-4194303"]  # grown, twice


def test_content_already_in_the_cache_is_linked_not_fetched(server, models):
    server.add(Repo("acme/Twins-GGUF", {"A-Q8_0.gguf": models["q8"], "B-Q8_0.gguf": models["q8"]}, tags=("gguf",)))
    hub = Hub(server.url)
    files = hub.files("acme/Twins-GGUF")
    pull(hub, files.find(file="A-Q8_0.gguf"))
    before, seen = len(server.requests), []
    path = pull(hub, files.find(file="B-Q8_0.gguf"), progress=seen.append)
    assert path.read_bytes() == models["q8"].read_bytes()
    assert not [p for method, p, _, _ in server.requests[before:] if method == "GET" and p.startswith("/cdn-lfs/")]
    assert seen[-1].done_bytes == seen[-1].total_bytes  # counted as done, not left at 0 %
