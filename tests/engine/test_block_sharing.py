"""Requests that run at once share the whole blocks of a common prompt prefix (KVCache.share, PrefixPool.take):
reference counts in the allocator, the scheduler on real tiny models, sliding windows, the disk store."""

import threading

import pytest
import torch
from factory import cpu_plan, make_model
from scheduler_log import Log

from stowage.engine.runtime.engine import Engine
from stowage.engine.runtime.generation import GenerationResult, TokenEvent
from stowage.engine.runtime.kv_cache import BlockAllocator, CacheSpec, KVCache, Sequence
from stowage.engine.serving.kv_store import KVStore
from stowage.engine.planning import plan_for
from stowage.engine.planning.budgets import DiskBudget, given_budgets
from stowage.engine.runtime.sampler import SamplingParams
from stowage.engine.serving.scheduler import Scheduler
from stowage.engine.units import GiB

PREFIX = [3 + (7 * i) % 500 for i in range(48)]  # three blocks of 16 in common
TAIL_A, TAIL_B = list(range(400, 410)), list(range(420, 432))
PROMPT_A, PROMPT_B = PREFIX + TAIL_A, PREFIX + TAIL_B
# windows of 8 (tests/engine/test_gemma.py) and chunks of 16, so the window layers recycle blocks: Gemma 2 (every
# other layer full) and Mistral (every layer windowed: no full-attention group at all)
WINDOWED_MODELS = {
    "gemma2": ("gemma2", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, initializer_range=0.2)),
    "mistral-window": ("mistral", dict(sliding_window=8, initializer_range=0.2)),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("sharing"), "llama", initializer_range=0.2)


@pytest.fixture(scope="module", params=list(WINDOWED_MODELS))
def window_dir(request, tmp_path_factory):
    arch, overrides = WINDOWED_MODELS[request.param]
    return make_model(tmp_path_factory.mktemp(request.param), arch, **overrides)




def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n)


def record_prefills(engine):
    """Wrap the model: a list of (seq, number of tokens) of each prefill forward, in call order (a decode step of
    one sequence is a forward too: left out)."""
    calls, model = [], engine.model
    forward, decode_step = model.forward, model.decode_step
    decoding = threading.local()

    def recording_forward(token_ids, seq, cache, *a, **k):
        if not getattr(decoding, "on", False):
            calls.append((seq, len(token_ids)))
        return forward(token_ids, seq, cache, *a, **k)

    def recording_decode(token_ids, seqs, cache):
        decoding.on = True
        try:
            return decode_step(token_ids, seqs, cache)
        finally:
            decoding.on = False

    model.forward, model.decode_step = recording_forward, recording_decode
    return calls


def load(model_dir, *, parallel=2, context=256, **request):
    engine = Engine.load(model_dir, cpu_plan(model_dir, context, num_seqs=parallel, **request))
    engine.eos_ids.clear()  # replies run to max_tokens: lengths known in advance
    return engine


def alone(model_dir, prompt_ids, n, **request):
    """A greedy reply by a fresh engine's single-sequence path: nothing cached, nothing shared."""
    engine = load(model_dir, parallel=1, **request)
    return engine.generate(prompt_ids, greedy(n)).run().token_ids


def held(cache):
    return [g.allocator.num_blocks - g.allocator.num_free for g in cache.groups]


def serve(engine, *requests, max_running=2):
    """Submit (name, prompt, max_tokens[, then]) before the scheduler starts: admitted together; the results."""
    scheduler = Scheduler(engine, max_running=max_running, max_waiting=4)
    log = Log()
    for name, prompt, n, *then in requests:
        scheduler.submit(prompt, greedy(n), log.emitter(name, *then), threading.Event())
    scheduler.start()
    try:
        return log.wait(*(r[0] for r in requests))
    finally:
        scheduler.close()  # the idle conversations are evicted


# -- the allocator and the cache ---------------------------------------------------------------------------------
def test_a_shared_block_is_free_again_only_when_its_last_holder_frees_it():
    alloc = BlockAllocator(4)
    a = alloc.allocate(2)
    alloc.share(a)
    assert [alloc.num_holders(b) for b in a] == [2, 2] and alloc.num_free == 2
    alloc.free(a)  # one holder lets go: nothing comes back
    assert alloc.num_free == 2 and [alloc.num_holders(b) for b in a] == [1, 1]
    assert set(alloc.allocate(2)).isdisjoint(a)  # the pool hands out only blocks nobody holds
    alloc.free(a)
    assert alloc.num_free == 2 and alloc.allocate(2) == a  # the last holder let go: reusable, in order


SPEC = CacheSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32, block_size=4)


def grow(cache, seq, n):
    cache.reserve(seq, n)
    seq.token_ids.extend(range(seq.num_tokens, seq.num_tokens + n))


def test_share_holds_the_whole_blocks_read_only_and_writes_start_in_a_block_of_its_own():
    cache = KVCache(SPEC, [torch.device("cpu")], context_tokens=16, num_seqs=2)  # 8 blocks
    a, b = Sequence(), Sequence()
    grow(cache, a, 10)  # blocks 0, 1 full; 2 holds 2 tokens
    assert cache.num_shareable(a, 10) == 8 and cache.num_shareable(a, 7) == 4
    assert cache.share(b, a, 10) == 8  # the partial block is never shared
    assert b.block_table == a.block_table[:2] and b.token_ids == a.token_ids[:8] and cache.allocator.num_free == 5
    slots = cache.reserve(b, 1)  # b's next token goes into a new block
    assert slots.tolist() == [[b.block_table[2] * 4]]
    assert b.block_table[2] not in a.block_table and cache.allocator.num_free == 4
    cache.release(a)  # a's own block (2) is free; the shared ones are b's still
    assert cache.allocator.num_free == 5 and [cache.allocator.num_holders(x) for x in b.block_table] == [1, 1, 1]
    cache.release(b)
    assert cache.allocator.num_free == 8


def test_truncate_inside_a_shared_block_keeps_whole_blocks_only():
    cache = KVCache(SPEC, [torch.device("cpu")], context_tokens=16, num_seqs=2)
    a, b = Sequence(), Sequence()
    grow(cache, a, 12)
    cache.share(b, a, 12)  # all three blocks
    # a continued from 6 tokens would write position 6 into block 1, which b reads: cut at its start
    assert cache.truncate(a, 6) == 4 and a.block_table == b.block_table[:1]
    assert cache.allocator.num_holders(b.block_table[1]) == 1
    assert cache.truncate(b, 6) == 6  # b holds block 1 alone now: kept in part
    cache.release(a)
    cache.release(b)
    assert cache.allocator.num_free == 8


def test_can_fit_counts_shared_blocks_once():
    cache = KVCache(SPEC, [torch.device("cpu")], context_tokens=16, num_seqs=1)  # 4 blocks
    a, b = Sequence(), Sequence()
    grow(cache, a, 12)  # 3 blocks held, 1 free
    cache.share(b, a, 12)
    assert cache.can_fit([(b, 4)]) and not cache.can_fit([(b, 5)])  # b needs a block past the 3 it shares
    assert not cache.can_fit([(a, 4), (b, 4)])  # one new block each, one free
    grow(cache, b, 4)
    assert cache.allocator.num_free == 0 and b.block_table[:3] == a.block_table


# Block size 4, window 6, chunks of up to 4 tokens: a window layer holds at most 3 blocks of a sequence
def windowed_cache(num_seqs=2):
    return KVCache(SPEC, [torch.device("cpu")] * 2, 64, num_seqs, layer_windows=(6, None), prefill_chunk=4)


def test_a_window_group_shares_only_what_it_still_holds():
    cache = windowed_cache()
    a, b, c = Sequence(), Sequence(), Sequence()
    for _ in range(3):
        grow(cache, a, 4)  # 12 tokens: the window group holds blocks 0..2, nothing recycled yet
    assert cache.share(b, a, 12) == 12
    # a chunk at 12 reads positions 7..15: the window group shares blocks 1 and 2, the full group all three
    assert b.window_tables[6] == [-1, *a.window_tables[6][1:]] and b.block_table == a.block_table
    for _ in range(4):
        grow(cache, a, 4)  # a recycles its window blocks 1 and 2: b still holds them
    window = cache.groups[1].allocator
    assert all(window.num_holders(x) == 1 for x in b.window_tables[6][1:])
    assert cache.num_shareable(a, 12) == 0  # a's window layers no longer hold positions 7..11
    assert cache.share(c, a, 12) == 0 and c.num_tokens == 0 and c.block_table == []


def test_can_fit_knows_a_recycled_window_block_another_holds_does_not_come_back():
    cache = windowed_cache(num_seqs=1)  # the window group: 3 blocks
    a, b = Sequence(), Sequence()
    for _ in range(2):
        grow(cache, a, 4)  # window blocks 0, 1
    cache.share(b, a, 8)  # b holds a's window blocks 0 and 1 (a chunk at 8 reads 3..11)
    grow(cache, b, 4)  # b: blocks 0, 1 and a new one; the window group is full
    assert cache.groups[1].allocator.num_free == 0
    # a's next chunk recycles its block 0, but b holds it: a needs a block that is not there
    assert not cache.can_fit([(a, 4)])
    cache.release(b)
    assert cache.can_fit([(a, 4)])


def test_can_fit_knows_the_last_of_two_sharers_to_recycle_a_window_block_hands_it_back():
    cache = windowed_cache(num_seqs=2)  # the window group: 6 blocks
    a, b, c = Sequence(), Sequence(), Sequence()
    for _ in range(4):
        grow(cache, a, 4)  # 16 tokens: a's window layers hold blocks 1..3
    cache.share(b, a, 16)  # a chunk at 16 reads 11..19: b holds a's blocks 2 and 3
    grow(cache, b, 4)
    grow(cache, a, 4)  # a and b: blocks 2 and 3 shared, one of their own each
    grow(cache, c, 4)
    window = cache.groups[1].allocator
    assert window.num_free == 1
    # a decode step of both (reserved in this order): a's next block takes the free one, since b still holds the
    # block a recycles; b's recycling then hands that block back, and b takes it
    assert cache.can_fit([(a, 4), (b, 4)]) and not cache.can_fit([(a, 4), (b, 4), (c, 4)])
    grow(cache, a, 4)
    grow(cache, b, 4)
    assert window.num_free == 0


# -- the scheduler on a real tiny model --------------------------------------------------------------------------
def test_requests_admitted_together_prefill_a_common_prefix_once(model_dir):
    engine = load(model_dir)
    calls = record_prefills(engine)
    a, b = serve(engine, ("A", PROMPT_A, 12), ("B", PROMPT_B, 12))
    assert a.token_ids == alone(model_dir, PROMPT_A, 12) and b.token_ids == alone(model_dir, PROMPT_B, 12)
    assert (a.reused_tokens, a.prefilled_tokens) == (0, len(PROMPT_A))
    assert (b.reused_tokens, b.prefilled_tokens) == (len(PREFIX), len(TAIL_B))  # only its tail
    assert [n for _, n in calls] == [len(PROMPT_A), len(TAIL_B)]
    assert engine.stats.prefilled_tokens == len(PROMPT_A) + len(TAIL_B)
    assert engine.stats.reused_tokens == len(PREFIX)
    assert held(engine.cache) == [0]  # both finished and evicted: every block is free


def test_a_request_that_arrives_while_another_decodes_shares_its_blocks(model_dir):
    engine = load(model_dir)
    scheduler = Scheduler(engine, max_running=2, max_waiting=0)
    log, decode_step = Log(), engine.model.decode_step

    def b_joins(token_ids, seqs, cache):  # on the scheduler thread, in A's third decode step
        logits = decode_step(token_ids, seqs, cache)
        if seqs[0].num_tokens == len(PROMPT_A) + 3:
            scheduler.submit(PROMPT_B, greedy(12), log.emitter("B"), threading.Event())
        return logits

    engine.model.decode_step = b_joins
    scheduler.submit(PROMPT_A, greedy(20), log.emitter("A"), threading.Event())
    scheduler.start()
    try:
        a, b = log.wait("A", "B")
    finally:
        scheduler.close()
    assert b.reused_tokens == len(PREFIX) and b.prefilled_tokens == len(TAIL_B)
    assert a.token_ids == alone(model_dir, PROMPT_A, 20) and b.token_ids == alone(model_dir, PROMPT_B, 12)
    assert held(engine.cache) == [0]


def test_cancelling_one_of_two_sharers_frees_only_its_own_blocks(model_dir):
    engine = load(model_dir)
    calls = record_prefills(engine)
    cancel_b, seen, at_cancel = threading.Event(), [], {}

    def b_cancels_after_three(event):
        seen.append(event)
        if len(seen) == 3:
            cancel_b.set()
        if isinstance(event, GenerationResult):  # sent once B's blocks are let go, before the next step
            a_seq = calls[0][0]
            at_cancel.update(held=held(engine.cache)[0], a_blocks=list(a_seq.block_table),
                             holders=[engine.cache.allocator.num_holders(x) for x in a_seq.block_table])

    scheduler = Scheduler(engine, max_running=2, max_waiting=0)
    log = Log()
    scheduler.submit(PROMPT_A, greedy(40), log.emitter("A"), threading.Event())
    scheduler.submit(PROMPT_B, greedy(40), log.emitter("B", then=b_cancels_after_three), cancel_b)
    scheduler.start()
    try:
        a, b = log.wait("A", "B")
    finally:
        scheduler.close()
    assert b.finish_reason == "cancelled" and b.reused_tokens == len(PREFIX)
    assert b.token_ids == alone(model_dir, PROMPT_B, 40)[: len(b.token_ids)]
    # A holds its blocks, the shared ones now alone: B's own blocks went back, nothing of A's
    assert at_cancel["held"] == len(at_cancel["a_blocks"]) and set(at_cancel["holders"]) == {1}
    assert a.finish_reason == "length" and a.token_ids == alone(model_dir, PROMPT_A, 40)
    assert held(engine.cache) == [0]


def test_an_idle_conversation_evicted_under_a_running_sharer_frees_only_its_own_blocks(model_dir):
    # two sequences of 64 tokens: 8 blocks; B and C below grow to the whole context (4 blocks each)
    engine = load(model_dir, context=64)
    scheduler = Scheduler(engine, max_running=2, max_waiting=2).start()
    log = Log()
    prompts = {"first": PREFIX[:40], "other": list(range(200, 231)),
               "B": PREFIX[:32] + TAIL_A, "C": PREFIX[:32] + TAIL_B}  # B, C: two blocks in common with first
    try:
        for name in ("first", "other"):  # idle after: 3 blocks each (48 and 39 tokens), 2 of 8 free
            scheduler.submit(prompts[name], greedy(8), log.emitter(name), threading.Event())
            log.wait(name)
        for name in ("B", "C"):
            scheduler.submit(prompts[name], greedy(64), log.emitter(name), threading.Event())
        b, c = log.wait("B", "C")
        num_idle = scheduler.pool.num_idle
    finally:
        scheduler.close()
    # B and C share first's two blocks; evicting first (least recently used) freed only its third block, so other
    # went too: 2 shared + 2 + 2 own blocks at the end
    assert b.reused_tokens == c.reused_tokens == 32 and num_idle == 2
    assert b.finish_reason == c.finish_reason == "context_full" and len(b.token_ids) == 64 - len(prompts["B"])
    # alone: the same loop on one sequence, so the same tokens up to the full context
    assert b.token_ids == alone(model_dir, prompts["B"], 64, context=64)[: len(b.token_ids)]
    assert c.token_ids == alone(model_dir, prompts["C"], 64, context=64)[: len(c.token_ids)]
    assert held(engine.cache) == [0]


def test_a_sliding_window_model_shares_while_its_window_layers_hold_the_prefix(window_dir):
    engine = load(window_dir, prefill_chunk=16)
    assert 8 in [g.window for g in engine.cache.groups]  # the window layers recycle
    a, b = serve(engine, ("A", PROMPT_A, 12), ("B", PROMPT_B, 12))
    assert b.reused_tokens == len(PREFIX) and b.prefilled_tokens == len(TAIL_B)
    assert a.token_ids == alone(window_dir, PROMPT_A, 12, prefill_chunk=16)
    assert b.token_ids == alone(window_dir, PROMPT_B, 12, prefill_chunk=16)
    assert set(held(engine.cache)) == {0}


def test_a_sliding_window_model_prefills_again_once_the_window_moved_past_the_prefix(window_dir):
    engine = load(window_dir, prefill_chunk=16)
    scheduler = Scheduler(engine, max_running=2, max_waiting=0)
    log, decode_step = Log(), engine.model.decode_step

    def b_joins_late(token_ids, seqs, cache):  # on the scheduler thread, in A's decode steps
        logits = decode_step(token_ids, seqs, cache)
        if seqs[0].num_tokens == len(PROMPT_A) + 30:  # 40 tokens past the prefix: its window blocks 2, 3 recycled
            scheduler.submit(PROMPT_B, greedy(12), log.emitter("B"), threading.Event())
        return logits

    engine.model.decode_step = b_joins_late
    scheduler.submit(PROMPT_A, greedy(40), log.emitter("A"), threading.Event())
    scheduler.start()
    try:
        a, b = log.wait("A", "B")
    finally:
        scheduler.close()
    assert b.reused_tokens == 0 and b.prefilled_tokens == len(PROMPT_B)  # the whole prompt: nothing shareable
    assert a.token_ids == alone(window_dir, PROMPT_A, 40, prefill_chunk=16)
    assert b.token_ids == alone(window_dir, PROMPT_B, 12, prefill_chunk=16)
    assert set(held(engine.cache)) == {0}


# -- the disk store ----------------------------------------------------------------------------------------------
def test_a_sequence_with_shared_blocks_round_trips_through_the_disk_store(model_dir, tmp_path):
    budgets = given_budgets([], 64 * GiB, disk=DiskBudget(str(tmp_path), 100 * GiB))
    engine = Engine.load(model_dir, plan_for(model_dir, 256, budgets, num_seqs=2, kv_disk_budget=1 * GiB))
    store, cache, model = KVStore.of(engine), engine.cache, engine.model
    a, b = Sequence(), Sequence()
    model.forward(PROMPT_A, a, cache)
    assert cache.share(b, a, len(PROMPT_A)) == len(PREFIX)
    model.forward(TAIL_B, b, cache)
    store.save(b)
    kept = model.forward([7, 8, 9], b, cache, all_logits=True)
    cache.release(a)
    cache.release(b)
    assert held(cache) == [0]
    entry, n = store.best(PROMPT_B + [7, 8, 9])
    assert n == len(PROMPT_B)
    back = Sequence()
    assert store.load(entry, n, back) and back.token_ids == PROMPT_B
    assert torch.equal(model.forward([7, 8, 9], back, cache, all_logits=True), kept)
    cache.release(back)
    assert held(cache) == [0]


def test_token_events_of_a_sharer_are_those_it_streams_alone(model_dir):
    """The text streamed (TokenEvents) follows the tokens: what a client sees is the same as alone."""
    engine = load(model_dir)
    log = Log()
    scheduler = Scheduler(engine, max_running=2, max_waiting=0)
    scheduler.submit(PROMPT_A, greedy(8), log.emitter("A"), threading.Event())
    scheduler.submit(PROMPT_B, greedy(8), log.emitter("B"), threading.Event())
    scheduler.start()
    try:
        _, b = log.wait("A", "B")
    finally:
        scheduler.close()
    streamed = "".join(e.text for name, e in log.events if name == "B" and isinstance(e, TokenEvent))
    reference = load(model_dir, parallel=1)
    assert streamed == b.text == reference.generate(PROMPT_B, greedy(8)).run().text
