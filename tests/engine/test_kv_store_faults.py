"""The KV store (engine/serving/kv_store.py) on a disk that turns against it (issue 31): a folder that turns
read-only, a FIFO and a folder where an entry should be. The store degrades to none, or skips the one file, with
one log line; the cache never loses a block and no request fails for it."""

import errno
import logging
import os
import threading
from pathlib import Path

import pytest
from factory import make_model
from scheduler_log import kv_files, run_to_end

from stowage.engine.planning import plan_for
from stowage.engine.planning.budgets import DiskBudget, given_budgets
from stowage.engine.runtime.engine import Engine
from stowage.engine.runtime.kv_cache import Sequence
from stowage.engine.serving.kv_store import KVStore
from stowage.engine.serving.scheduler import Scheduler
from stowage.engine.units import GiB

LOGGER = "stowage.engine.serving.kv_store"
TIMEOUT = 60
PROMPT_A = [3 + (7 * i) % 500 for i in range(150)]
PROMPT_B = [5 + (11 * i) % 500 for i in range(150)]


def load(model_dir, kv_dir) -> Engine:
    """An engine of 256 tokens (one chat's blocks at a time) whose evicted chats go to kv_dir (as test_kv_store.py)."""
    budgets = given_budgets([], 64 * GiB, disk=DiskBudget(str(kv_dir), 100 * GiB))
    engine = Engine.load(model_dir, plan_for(model_dir, 256, budgets, kv_disk_budget=GiB, prefill_chunk=16))
    engine.eos_ids.clear()  # replies run to max_tokens
    return engine




@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("kv_faults"), "llama", initializer_range=0.2)


def make_read_only(folder: Path, monkeypatch) -> None:
    """The folder turns read-only under a running server, as a remount or a revoked permission does.

    chmod does it for a user; root (as tests often run in containers) writes through any mode bits, and remounting
    needs privileges a test has not got. Then the OSError a read-only mount gives is raised where the filesystem
    would raise it: every call that creates, renames or removes a file under the folder. As on a real read-only
    mount, removing a file that does not exist fails too (Linux checks the mount before it looks the name up):
    that is what made the store's clean-up raise inside its own error handler."""
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    probe = folder / next(folder.iterdir()).name / "probe"
    try:
        probe.write_bytes(b"")
    except PermissionError:
        return  # the modes hold: a real read-only folder
    probe.unlink()
    root = str(folder)

    def under(path) -> bool:
        return isinstance(path, (str, os.PathLike)) and os.fspath(path).startswith(root)

    def refuse(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

    real_open, real_os_open = open, os.open

    def fake_open(file, mode="r", *args, **kwargs):
        if under(file) and any(c in mode for c in "wax+"):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def fake_os_open(path, flags, *args, **kwargs):
        if under(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    monkeypatch.setattr(os, "open", fake_os_open)
    for name in ("unlink", "remove", "rmdir", "mkdir"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda path, *a, _real=real, **k: refuse(path) if under(path)
                            else _real(path, *a, **k))
    for name in ("replace", "rename"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda src, dst, *a, _real=real, **k: refuse(dst) if under(dst)
                            else _real(src, dst, *a, **k))
    real_utime = os.utime
    monkeypatch.setattr(os, "utime", lambda path, *a, **k: refuse(path) if under(path) else real_utime(path, *a, **k))


@pytest.fixture
def writable_again(tmp_path):
    yield
    for path in [tmp_path, *tmp_path.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def test_a_store_that_turns_read_only_is_dropped_and_no_block_is_lost(model_dir, tmp_path, monkeypatch, caplog,
                                                                       writable_again):
    engine = load(model_dir, tmp_path)  # 256 tokens: one chat's blocks at a time, the other is evicted to disk
    cache = engine.cache
    scheduler = Scheduler(engine, max_running=1, max_waiting=4).start()
    try:
        a = run_to_end(scheduler, PROMPT_A, 20)
        run_to_end(scheduler, PROMPT_B, 20)  # A written to disk
        assert len(kv_files(tmp_path)) == 1 and engine.pool.store is not None
        make_read_only(tmp_path, monkeypatch)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            # A's next turn reads A back, evicting B, whose write fails; then each turn evicts the other chat
            again = run_to_end(scheduler, PROMPT_A + a.token_ids + [7], 5)
            for turn in range(3):
                run_to_end(scheduler, PROMPT_B + [9] * turn, 5)
                run_to_end(scheduler, PROMPT_A + [9] * turn, 5)
    finally:
        scheduler.close()
    assert again.reused_tokens == len(PROMPT_A) + len(a.token_ids) - 1  # read back while the store turned off
    assert engine.pool.store.is_off and engine.pool.store.entries == []  # degraded to no store
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1 and "KV cache files off" in warnings[0], warnings
    assert engine.pool.num_idle == 0  # every block came back
    assert all(g.allocator.num_free == g.allocator.num_blocks for g in cache.groups)


def test_a_fifo_or_a_folder_named_like_an_entry_is_skipped_at_start(model_dir, tmp_path, caplog):
    engine = load(model_dir, tmp_path)
    store = engine.pool.store
    seq = Sequence()
    engine.model.forward(PROMPT_A[:100], seq, engine.cache)
    store.save(seq)
    engine.cache.release(seq)
    fifo, folder = store.dir / ("0" * 24 + ".kv"), store.dir / ("d" * 24 + ".kv")
    os.mkfifo(fifo)
    folder.mkdir()
    started = []
    thread = threading.Thread(target=lambda: started.append(KVStore(tmp_path, store.key, 1 << 30, engine.cache)),
                              daemon=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        thread.start()
        thread.join(10)
        if thread.is_alive():  # reading the FIFO waits for a writer: be one, so the test ends
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            thread.join(10)
            pytest.fail("opening the store waited on a FIFO named like an entry")
    (again,) = started
    assert [e.path for e in again.entries] == [p for p in kv_files(tmp_path) if p.is_file()]  # the real entry only
    assert fifo.exists() and folder.is_dir()  # not ours to delete
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 2 and all("not a regular file; ignored" in w for w in warnings), warnings


def test_an_entry_that_cannot_be_deleted_is_a_miss_and_one_log_line(model_dir, tmp_path, caplog):
    engine = load(model_dir, tmp_path)
    store = engine.pool.store
    seq = Sequence()
    engine.model.forward(PROMPT_A[:100], seq, engine.cache)
    store.save(seq)
    engine.cache.release(seq)
    (path,) = kv_files(tmp_path)
    path.unlink()
    (path / "inside").mkdir(parents=True)  # a folder, not empty: neither read nor deleted
    scheduler = Scheduler(engine, max_running=1, max_waiting=4).start()
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            result = run_to_end(scheduler, PROMPT_A, 5)
            run_to_end(scheduler, PROMPT_A, 5)
    finally:
        scheduler.close()
    assert result.reused_tokens == 0 and result.prefilled_tokens == len(PROMPT_A)
    assert path not in [e.path for e in store.entries] and not store.is_off  # the store goes on without it
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1 and "cannot delete it" in warnings[0], warnings
