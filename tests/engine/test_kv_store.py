"""Evicted conversations' K/V written to disk and read back (engine/serving/kv_store.py) on real tiny models and files."""

import os
import time

import pytest
import torch
from factory import make_model
from scheduler_log import kv_files, run_to_end

from stowage.engine.runtime.engine import Engine
from stowage.engine.runtime.kv_cache import Sequence
from stowage.engine.serving.kv_store import KVStore
from stowage.engine.planning import plan_for
from stowage.engine.planning.budgets import DiskBudget, given_budgets
from stowage.engine.serving.scheduler import Scheduler
from stowage.engine.units import GiB, MiB

TIMEOUT = 60
PROMPT_A = [3 + (7 * i) % 500 for i in range(150)]
PROMPT_B = [5 + (11 * i) % 500 for i in range(150)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("kv_store"), "llama", initializer_range=0.2)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    # Gemma 2 with windows of 8 (tests/engine/test_gemma.py): the window layers recycle all but their last blocks
    return make_model(tmp_path_factory.mktemp("kv_store_gemma"), "gemma2", head_dim=16, query_pre_attn_scalar=24,
                      sliding_window=8, initializer_range=0.2)


def load(model_dir, kv_dir, *, context=256, parallel=1, budget=1 * GiB, **request):
    budgets = given_budgets([], 64 * GiB, disk=DiskBudget(str(kv_dir), 100 * GiB))
    plan = plan_for(model_dir, context, budgets, num_seqs=parallel, kv_disk_budget=budget, prefill_chunk=16,
                    **request)
    engine = Engine.load(model_dir, plan)
    engine.eos_ids.clear()  # replies run to max_tokens
    return engine


def switch_back(engine):
    """Chat A, then chat B (whose blocks need A's: A is written to disk), then A's next turn; the three results."""
    scheduler = Scheduler(engine, max_running=1, max_waiting=4).start()
    try:
        a = run_to_end(scheduler, PROMPT_A, 20)
        b = run_to_end(scheduler, PROMPT_B, 20)
        again = run_to_end(scheduler, PROMPT_A + a.token_ids + [7, 8, 9], 20)
    finally:
        scheduler.close()
    return a, b, again


def never_evicted(model_dir, kv_dir, **request):
    """A's next turn on an engine with room for both chats and no disk: the reference."""
    engine = load(model_dir, kv_dir, context=512, budget=0, **request)
    scheduler = Scheduler(engine, max_running=1, max_waiting=4).start()
    try:
        a = run_to_end(scheduler, PROMPT_A, 20)
        run_to_end(scheduler, PROMPT_B, 20)
        return run_to_end(scheduler, PROMPT_A + a.token_ids + [7, 8, 9], 20)
    finally:
        scheduler.close()


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_a_chat_read_back_from_disk_continues_exactly(model_dir, tmp_path, kv_dtype):
    engine = load(model_dir, tmp_path, kv_dtype=kv_dtype)  # 256 tokens: one chat's blocks at a time
    a, b, again = switch_back(engine)
    assert again.reused_tokens == len(PROMPT_A) + len(a.token_ids) - 1  # all A held but its last reply token
    assert again.prefilled_tokens == 4  # that token and the 3 new ones: nothing of A recomputed
    reference = never_evicted(model_dir, tmp_path / "unused", kv_dtype=kv_dtype)
    assert reference.reused_tokens == again.reused_tokens
    assert again.token_ids == reference.token_ids


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_logits_after_a_read_back_are_those_of_the_cache_never_evicted(model_dir, tmp_path, kv_dtype):
    engine = load(model_dir, tmp_path, kv_dtype=kv_dtype)
    store, cache, model = KVStore.of(engine), engine.cache, engine.model
    seq = Sequence()
    model.forward(PROMPT_A[:100], seq, cache)
    store.save(seq)
    kept = model.forward(PROMPT_A[100:], seq, cache, all_logits=True)
    cache.release(seq)
    entry, n = store.best(PROMPT_A)
    assert n == 100
    back = Sequence()
    assert store.load(entry, n, back)
    assert back.token_ids == PROMPT_A[:100]
    assert torch.equal(model.forward(PROMPT_A[100:], back, cache, all_logits=True), kept)
    # a prompt that shares only part of it reads only that part's blocks
    cache.release(back)
    entry, n = store.best(PROMPT_A[:40] + [9, 9])
    part = Sequence()
    assert n == 40 and store.load(entry, n, part) and part.num_tokens == 40


def test_the_server_end_writes_idle_chats_and_a_new_server_resumes_them(model_dir, tmp_path):
    engine = load(model_dir, tmp_path)
    scheduler = Scheduler(engine, max_running=1, max_waiting=4).start()
    a = run_to_end(scheduler, PROMPT_A, 20)
    scheduler.close()  # the idle chat is written on the way out
    assert len(kv_files(tmp_path)) == 1
    restarted = Scheduler(load(model_dir, tmp_path), max_running=1, max_waiting=4).start()
    try:
        again = run_to_end(restarted, PROMPT_A + a.token_ids + [7], 5)
    finally:
        restarted.close()
    assert again.reused_tokens == len(PROMPT_A) + len(a.token_ids) - 1


def test_the_budget_deletes_the_least_recently_used_files(model_dir, tmp_path):
    engine = load(model_dir, tmp_path)
    one = KVStore.of(engine)
    seq = Sequence()
    engine.model.forward(PROMPT_A[:100], seq, engine.cache)
    one.save(seq)
    size = one.num_bytes
    assert size > 100 * 3 * 2 * 2 * 16 * 4  # 100 tokens x 3 layers x K,V x 2 heads x 16 dims x fp32 (7 blocks)
    engine.cache.release(seq)
    (oldest,) = kv_files(tmp_path)
    small = KVStore(tmp_path, one.key, int(2.5 * size), engine.cache)
    for start in (0, 200, 300):  # three conversations of the same length: room for two
        time.sleep(0.05)  # file times order them (coarse clocks tick every few ms)
        seq = Sequence()
        engine.model.forward([start + i % 7 for i in range(100)], seq, engine.cache)
        small.save(seq)
        engine.cache.release(seq)
        if start == 0:
            second = (set(kv_files(tmp_path)) - {oldest}).pop()
    assert len(kv_files(tmp_path)) == 2 and small.num_bytes <= 2.5 * size
    assert oldest not in kv_files(tmp_path) and second not in kv_files(tmp_path)  # A's, then the first of the three
    assert KVStore(tmp_path, one.key, 0, engine.cache).best(PROMPT_A) == (None, 0)  # A's entry is gone


def test_a_changed_model_file_or_cache_dtype_is_a_miss(model_dir, tmp_path):
    engine = load(model_dir, tmp_path)
    store = KVStore.of(engine)
    seq = Sequence()
    engine.model.forward(PROMPT_A[:100], seq, engine.cache)
    store.save(seq)
    assert KVStore.of(load(model_dir, tmp_path)).best(PROMPT_A)[1] == 100  # the same model: a hit
    assert KVStore.of(load(model_dir, tmp_path, kv_dtype="bfloat16")).best(PROMPT_A) == (None, 0)
    weights = model_dir / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten (same size)
    try:
        assert KVStore.of(load(model_dir, tmp_path)).best(PROMPT_A) == (None, 0)
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("damage", ["truncate", "flip a K/V byte", "flip a header byte"])
def test_a_damaged_file_is_a_miss_and_is_deleted(model_dir, tmp_path, damage):
    engine = load(model_dir, tmp_path)
    store = KVStore.of(engine)
    seq = Sequence()
    engine.model.forward(PROMPT_A[:100], seq, engine.cache)
    store.save(seq)
    engine.cache.release(seq)
    (path,) = kv_files(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 1000]
    else:
        data[len(data) // 2 if "K/V" in damage else 20] ^= 0x40
    path.write_bytes(bytes(data))
    fresh = load(model_dir, tmp_path)
    scheduler = Scheduler(fresh, max_running=1, max_waiting=4).start()
    try:
        result = run_to_end(scheduler, PROMPT_A, 5)  # the header is read at start, the blocks when taken
    finally:
        scheduler.close()
    assert result.reused_tokens == 0 and result.prefilled_tokens == len(PROMPT_A)
    assert path not in kv_files(tmp_path)


def test_a_sliding_window_model_reads_back_what_its_window_layers_hold(gemma_dir, tmp_path):
    engine = load(gemma_dir, tmp_path)
    window = engine.cache.groups[-1]
    assert window.window == 8 and window.max_blocks_per_seq < 256 // 16  # the window layers recycle
    a, b, again = switch_back(engine)
    assert again.reused_tokens == len(PROMPT_A) + len(a.token_ids) - 1
    reference = never_evicted(gemma_dir, tmp_path / "unused")
    assert again.token_ids == reference.token_ids
    # the file holds the window layers' last blocks only: a prompt that leaves the chat early reads nothing
    store = KVStore.of(engine)
    assert store.best(PROMPT_A[:60] + [1, 2])[1] == 0


def test_the_plan_says_the_spill_budget_and_the_disk_it_fits_in(model_dir, tmp_path):
    from stowage.engine.planning.budgets import default_kv_disk_budget
    from stowage.engine.planning.report import format_table, to_dict

    assert default_kv_disk_budget(100 * GiB) == 4 * GiB  # capped
    assert default_kv_disk_budget(10 * GiB) == 1 * GiB  # 10% of the free disk
    disk = DiskBudget(str(tmp_path), 10 * GiB)

    def spill(**request):
        p = plan_for(model_dir, 256, given_budgets([], 64 * GiB, disk=disk), **request)
        return p.kv_disk_bytes, p.kv_disk_free_bytes, p.kv_dir

    assert spill() == (1 * GiB, 10 * GiB, str(tmp_path))
    assert spill(kv_disk_budget=512 * MiB)[0] == 512 * MiB
    assert spill(kv_disk_budget=20 * GiB)[0] == 10 * GiB  # never more than is free
    assert spill(kv_disk_budget=0)[0] == 0
    assert plan_for(model_dir, 256, given_budgets([], 64 * GiB)).kv_disk_bytes == 0  # no disk given: no spill
    p = plan_for(model_dir, 256, given_budgets([], 64 * GiB, disk=disk))
    assert to_dict(p)["kv_disk_bytes"] == GiB and to_dict(p)["kv_dir"] == str(tmp_path)
    assert f"KV spill to disk: 1.0 GiB for evicted conversations in {tmp_path} (10.0 GiB free there)" in format_table(p)
    with pytest.raises(ValueError, match="kv_disk_budget"):
        plan_for(model_dir, 256, given_budgets([], 64 * GiB, disk=disk), kv_disk_budget=-1)


def test_serve_and_plan_take_the_budget_and_the_folder_from_the_environment(monkeypatch, tmp_path):
    import argparse

    from stowage.engine.planning.budgets import detect_disk
    from stowage.engine.cli.plan import add_plan_parser
    from stowage.engine.cli.serve import add_serve_parser

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_serve_parser(sub)
    add_plan_parser(sub)
    assert parser.parse_args(["serve", "m", "--kv-disk-budget", "2GiB"]).kv_disk_budget == 2 * GiB
    assert parser.parse_args(["serve", "m", "--kv-disk-budget", "0"]).kv_disk_budget == 0
    assert parser.parse_args(["plan", "m"]).kv_disk_budget is None
    monkeypatch.setenv("STOWAGE_KV_DIR", str(tmp_path / "not-made-yet"))
    disk = detect_disk()
    assert disk.folder == str(tmp_path / "not-made-yet") and disk.free_bytes > 0  # the disk it will be on
