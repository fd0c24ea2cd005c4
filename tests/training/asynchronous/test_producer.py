"""The rollout producer (training/asynchronous/producer.py) on a fake engine: batches in prompt order
with the lag bound, the pause around weight updates, resume without losing or repeating a
prompt, dynamic sampling with the buffer, errors and a clean stop.

Mutations tried: `AsyncRollout.snapshot` without the buffer's pending prompts fails
`test_resume_loses_and_repeats_no_prompt` (the prompts in flight are lost); the producer
treating every group as kept fails `test_filtered_groups_do_not_count`."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from hapo_megatron.config import load_config
from hapo_megatron.data.sampler import PromptSampler
from hapo_megatron.rollout.engine import Sample
from hapo_megatron.training.asynchronous.buffer import BufferClosed
from hapo_megatron.training.asynchronous.producer import AsyncRollout
from tests.rollout.standin_engine import StandInEngine

B, N, PROMPTS = 2, 2, 40  # groups per batch, responses per group


class FakeEngine(StandInEngine):
    """Answers each group with ``N`` 3-token responses of the weight version it holds; records
    the pause / continue calls. ``fail`` raises in generate."""

    def __init__(self):
        self.version, self.events, self.fail = 0, [], None
        self.lock = threading.Lock()

    def generate(self, prompt_ids, params, on_samples=None):
        if self.fail is not None:
            raise self.fail
        with self.lock:
            self.events.append(("generate", prompt_ids[0][1]))
        return [[Sample(prompt_ids=p, response_ids=[5, 6, 7], rollout_logprobs=[-1.0] * 3, temperatures=[],
                        finish_reason="length", prompt_index=0, sample_index=k, weight_versions=[self.version] * 3)
                 for k in range(params.n)] for p in prompt_ids]

    def pause_generation(self, mode="retract"):
        self.events.append(("pause", mode))

    def continue_generation(self):
        self.events.append(("continue", None))


class FakeScorer:
    """Reward: +1 for the first response, -1 for the others; prompts in ``constant`` get -1 for
    all (dynamic sampling filters them)."""

    def __init__(self, constant=()):
        self.constant = set(constant)

    def start(self, records, decode):
        scorer = self

        class Round:
            def add(self, samples):
                pass

            def results(self, samples, counts):
                out = []
                for rec, group in zip(records, samples):
                    out.append([SimpleNamespace(score=1.0 if k == 0 and rec.index not in scorer.constant else -1.0,
                                                acc=k == 0 and rec.index not in scorer.constant)
                                for k in range(len(group))])
                return out
        return Round()


def _rt(k=1, *, filter_groups=False, constant=(), step=0, sampler_state=None, extra=()):
    cfg = load_config(overrides=[
        "rollout.engine=sglang", "rollout.sglang.colocate=false", f"rollout.max_staleness={k}",
        f"data.train_batch_size={B}", f"trainer.ppo_mini_batch_size={B}", f"rollout.n={N}",
        f"algo.filter_groups={str(filter_groups).lower()}", "rollout.max_response_length=8", *extra])
    ds = [SimpleNamespace(prompt_ids=[1, i + 10], data_source="t", index=i) for i in range(PROMPTS)]
    sampler = PromptSampler(ds, B, seed=3, shuffle=True)
    if sampler_state is not None:
        sampler.load_state_dict(sampler_state)
    return SimpleNamespace(cfg=cfg, train_ds=ds, engine=FakeEngine(), scorer=FakeScorer(constant),
                           tokenizer=SimpleNamespace(decode=lambda ids, **kw: "", eos_token_id=None),
                           sampling_seed=lambda s, g: s * 1000 + g,
                           rl=SimpleNamespace(step=step, sampler=sampler, rollout_entropy_stats=None))


def _prompts(batch):
    """The prompt of each group of a taken batch (its second token is 10 + the dataset index)."""
    return [int(batch.prompt_ids[i][1]) - 10 for i in range(0, len(batch), N)]


def _train(ar, rt, steps):
    """Take ``steps`` batches, 'training' each and updating the weights inside the pause."""
    got = []
    for _ in range(steps):
        kept, metrics, snap, seq_stats = ar.take_step(rt.rl.step + 1)
        assert metrics["rollout/staleness_max"] <= ar.k and len(seq_stats) == len(kept) == B * N
        got.append((_prompts(kept), metrics, snap))
        rt.rl.step += 1
        with ar.paused(rt.rl.step):
            rt.engine.version = rt.rl.step
    return got


def _sampler_order(n):
    ds = list(range(PROMPTS))
    s = PromptSampler(ds, B, seed=3, shuffle=True)
    return [i for _ in range(n // B) for i in s.next_indices()]


@pytest.mark.parametrize("k", [1, 2])
def test_batches_in_prompt_order_within_the_lag(k):
    rt = _rt(k)
    ar = AsyncRollout(rt).start()
    try:
        got = _train(ar, rt, 5)
    finally:
        ar.close()
    assert [p for g in got for p in g[0]] == _sampler_order(5 * B)
    # how far the producer ran ahead depends on thread timing here; that it may go exactly k
    # versions ahead is tests/training/asynchronous/test_buffer.py's
    assert max(g[1]["rollout/staleness_max"] for g in got) <= k
    for key in ("timing/trainer_wait_s", "rollout/generation_overlap_frac", "rollout/staleness_mean"):
        assert key in got[-1][1]
    pauses = [c for c in rt.engine.events if c[0] != "generate"]
    assert pauses == [("pause", "retract"), ("continue", None)] * 5


def test_resume_loses_and_repeats_no_prompt():
    whole = _rt()
    ar = AsyncRollout(whole).start()
    try:
        want = [p for g in _train(ar, whole, 4) for p in g[0]]
    finally:
        ar.close()
    first = _rt()
    ar = AsyncRollout(first).start()
    try:
        got = _train(ar, first, 2)
    finally:
        ar.close()
    snap = got[-1][2]
    assert snap["pending"], "the checkpoint should hold prompts in flight (a non-empty buffer)"
    resumed = _rt(step=2, sampler_state=snap["sampler"])
    resumed.engine.version = 2  # the first weight sync of the resumed run (trainer.fit)
    ar = AsyncRollout(resumed, pending=snap["pending"]).start()
    try:
        again = _train(ar, resumed, 2)
    finally:
        ar.close()
    assert [p for g in got + again for p in g[0]] == want


def test_filtered_groups_do_not_count():
    order = _sampler_order(12)
    constant = set(order[1:12:3])  # every third prompt from the second: all responses -1
    rt = _rt(filter_groups=True, constant=constant)
    ar = AsyncRollout(rt).start()
    try:
        got = _train(ar, rt, 3)
    finally:
        ar.close()
    trained = [p for g in got for p in g[0]]
    assert trained == [p for p in order if p not in constant][:3 * B]
    assert got[-1][1]["rollout/kept_group_frac"] < 1.0


def test_an_engine_error_reaches_the_trainer_and_close_stops_the_producer():
    rt = _rt()
    rt.engine.fail = RuntimeError("all servers gone")
    ar = AsyncRollout(rt).start()
    with pytest.raises(RuntimeError, match="all servers gone"):
        ar.take_step(1)
    ar.close()
    assert not ar._thread.is_alive()
    with pytest.raises(BufferClosed):
        ar.buffer.take(timeout=0)


class _LateRequestEngine(FakeEngine):
    """A server on which every group's request arrives just after the first abort (the group
    passed its stop check before it) and runs until an abort that comes after it."""

    def __init__(self):
        super().__init__()
        self.started, self.aborts, self.cond = 0, 0, threading.Condition()

    def generate(self, prompt_ids, params, on_samples=None):
        with self.cond:
            self.started += 1
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.aborts >= 1, timeout=30)  # sent after the first abort ...
            seen = self.aborts
            self.cond.wait_for(lambda: self.aborts > seen, timeout=30)  # ... so only a later one ends it
        raise RuntimeError("aborted")

    def abort_requests(self):
        with self.cond:
            self.aborts += 1
            self.cond.notify_all()


def test_close_aborts_again_the_requests_sent_after_its_first_abort():
    """close() sends the abort again until every group in flight is back: a request that reached
    the server after the first abort would otherwise run on (and the interpreter's exit wait for
    the thread that sent it)."""
    rt = _rt()
    rt.engine = engine = _LateRequestEngine()
    ar = AsyncRollout(rt).start()
    with engine.cond:
        engine.cond.wait_for(lambda: engine.started >= 1)
    ar.close()
    assert engine.aborts >= 2 and ar._in_flight == 0
    assert not ar._thread.is_alive()


class _SyncEngine(StandInEngine):
    """Reads every tensor; records the call and the keywords the loop passed."""

    def __init__(self):
        self.updates = []

    def update_weights(self, named_tensors, *, weight_version=None, flush_cache=True):
        self.updates.append((sum(1 for _ in named_tensors), weight_version, flush_cache))


def _sync_rt(k, async_rollout=None):
    import torch
    from hapo_megatron.training.memory.engine_memory import EngineMemory
    cfg = _rt(k).cfg if k else load_config(overrides=[])
    actor = SimpleNamespace(export_hf_weights=lambda dtype=None: iter([("w", torch.zeros(2))] * 3))
    return SimpleNamespace(cfg=cfg, engine=_SyncEngine(), actor=actor, memory=EngineMemory(),
                           rl=SimpleNamespace(step=7), async_rollout=async_rollout)


def test_weight_sync_is_untouched_without_staleness_and_versioned_with_it():
    """max_staleness 0: `update_weights(named)` exactly as before (no version, no pause), what keeps
    the synchronous loop identical; >= 1: tagged with the step, inside the producer's pause."""
    from hapo_megatron.training import stages
    rt = _sync_rt(0)
    stages.sync_weights(rt)
    assert rt.engine.updates == [(3, None, True)]
    events = []

    class Producer:
        def paused(self, version):
            class P:
                def __enter__(self):
                    events.append(("pause", version))

                def __exit__(self, *a):
                    events.append(("continue", version))
            return P()
    rt = _sync_rt(1, Producer())
    stages.sync_weights(rt)
    assert rt.engine.updates == [(3, 7, True)]
    assert events == [("pause", 7), ("continue", 7)]


def test_pause_in_place_reaches_the_servers_and_keeps_their_cache():
    """``pause_mode: in_place``: the producer pauses the servers in that mode, and the update
    does not flush their KV cache (SGLang fails an update whose flush finds requests running)."""
    from hapo_megatron.training import stages
    rt = _rt()
    rt.cfg.rollout.sglang.pause_mode = "in_place"
    ar = AsyncRollout(rt).start()
    try:
        _train(ar, rt, 2)
    finally:
        ar.close()
    assert [c for c in rt.engine.events if c[0] == "pause"] == [("pause", "in_place")] * 2
    sync = _sync_rt(1, ar)  # the next update, through the producer's pause (on rt.engine)
    sync.cfg.rollout.sglang.pause_mode = "in_place"
    stages.sync_weights(sync)
    assert sync.engine.updates == [(3, 7, False)]
    assert rt.engine.events[-2:] == [("pause", "in_place"), ("continue", None)]


class SlowGroupEngine(FakeEngine):
    """`FakeEngine`, but the group of prompt ``slow`` holds its answer (tokens of the version at
    its start) until ``release`` is set."""

    def __init__(self, slow):
        super().__init__()
        self.slow, self.release = slow, threading.Event()

    def generate(self, prompt_ids, params, on_samples=None):
        if prompt_ids[0][1] - 10 != self.slow:
            return super().generate(prompt_ids, params, on_samples)
        version = self.version
        assert self.release.wait(timeout=120), "the slow group was never released"
        return [[Sample(prompt_ids=p, response_ids=[5, 6, 7], rollout_logprobs=[-1.0] * 3, temperatures=[],
                        finish_reason="length", prompt_index=0, sample_index=k, weight_versions=[version] * 3)
                 for k in range(params.n)] for p in prompt_ids]


def test_over_sampling_passes_over_a_slow_group_and_masks_its_tokens_past_the_bound():
    """``rollout.over_sampling: 2`` with ``max_staleness: 1`` and ``partial_mode: mask_prefix``: the
    first prompt's group holds its answer; steps 1 and 2 train without it (passed over), it trains
    once released, sampled at version 0 in a batch of version >= 2: its tokens are masked, every
    other token trains. Mutation tried: the buffer taking in admission order (over-sampling
    ignored): step 1 waits for the slow group (the test times out on its release wait)."""
    rt = _rt(1, extra=["rollout.over_sampling=2", "rollout.partial_mode=mask_prefix"])
    slow = _sampler_order(B)[0]
    rt.engine = SlowGroupEngine(slow)
    ar = AsyncRollout(rt).start()
    finished, finish = threading.Event(), ar.buffer.finish

    def finish_and_tell(group):  # the released group's turn must not depend on thread scheduling
        finish(group)
        if group.prompt_index == slow:
            finished.set()
    ar.buffer.finish = finish_and_tell
    seen = []
    try:
        for step in range(1, 7):
            kept, metrics, _, _ = ar.take_step(step)
            prompts = _prompts(kept)
            seen.append((prompts, metrics, kept))
            if slow in prompts:
                break
            rt.rl.step = step
            with ar.paused(step):
                rt.engine.version = step
            if step == 2:  # released: the next batch starts with it, the oldest group in flight
                rt.engine.release.set()
                assert finished.wait(timeout=120), "the released group never finished"
    finally:
        rt.engine.release.set()
        ar.close()
    assert slow not in seen[0][0] and seen[0][1]["rollout/passed_over_groups"] >= 1
    prompts, metrics, kept = seen[-1]
    assert slow in prompts and len(seen) >= 3 and metrics["rollout/staleness_max"] >= 2
    for i in range(len(kept)):
        mask = list(kept.token_mask[i])
        assert mask == ([0.0] * 3 if int(kept.prompt_ids[i][1]) - 10 == slow else [1.0] * 3)
    trained = [p for s in seen for p in s[0]]
    assert len(trained) == len(set(trained))  # none twice
