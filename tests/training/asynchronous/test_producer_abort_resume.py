"""``rollout.sglang.pause_mode: abort`` (training/asynchronous/producer.py, AReaL's interruptible
generation): the pause before a weight update aborts the rows running; each resumes under the new
weights from its own tokens (prompt + partial response as input, the rest of its budget, its
seed), every token keeps the version that sampled it, and the group's lag counts from its oldest.

Mutations tried: resuming from the prompt alone (`row_requests` without the partial tokens) fails
the resumed inputs' check; tagging every token with the version of the last call fails the
versions' check; the former behaviour (the whole group sent again through `generate`) fails at once
(the scripted engine's `generate` is not scripted)."""

from __future__ import annotations

import threading
import time

from hapo_megatron.rollout.engine import ABORT, RowResult
from hapo_megatron.training.asynchronous.producer import AsyncRollout
from tests.rollout.standin_engine import StandInEngine
from tests.training.asynchronous.test_producer import B, N, _rt

FIRST = 2  # tokens a row has when the pause aborts it
BOUND_S = 60.0  # a call or a take that waits this long ends: the test fails, not hangs


class AbortingServers(StandInEngine):
    """A first call (input: the prompt alone) samples ``FIRST`` tokens under the version it holds
    and runs until a pause (or an abort) ends it; a resumed call finishes at once, under the version held then.
    The token at position ``j`` of a row is ``10 * (seed % 7) + j`` (a function of the row and the
    position: a resumed row continues the same response)."""

    send_sampling_seed = True

    def __init__(self):
        self.version, self.cond, self.paused = 0, threading.Condition(), 0
        self.first_calls, self.resumed_inputs = 0, []

    def generate_group(self, rows, params):
        with self.cond:
            prompt_len = 2  # the dataset's prompts: [1, 10 + i]
            if all(len(r.input_ids) == prompt_len for r in rows):
                self.first_calls += 1
                version, seen = self.version, self.paused
                self.cond.notify_all()
                self.cond.wait_for(lambda: self.paused > seen, timeout=BOUND_S)
                return [self._row(r, FIRST, version, ABORT) for r in rows]
            self.resumed_inputs += [r.input_ids for r in rows]
            return [self._row(r, r.max_new_tokens, self.version, "length") for r in rows]

    @staticmethod
    def _row(r, count, version, reason):
        done = len(r.input_ids) - 2
        toks = tuple(10 * (r.seed % 7) + done + j for j in range(count))
        return RowResult(toks, tuple(-0.5 for _ in toks), reason, tuple(version for _ in toks))

    def pause_generation(self, mode="retract"):
        assert mode == "abort"
        self.abort_requests()

    def abort_requests(self):  # the pause's abort, or close()'s
        with self.cond:
            self.paused += 1
            self.cond.notify_all()


def test_aborted_rows_resume_under_the_new_weights_from_their_tokens():
    rt = _rt(1)
    rt.cfg.rollout.sglang.pause_mode = "abort"
    rt.engine = servers = AbortingServers()
    ar = AsyncRollout(rt)
    finished, finish = [], ar.buffer.finish
    ar.buffer.finish = lambda group: (finished.append((group.min_version, group.max_version)), finish(group))[1]
    ar.start()
    try:
        with servers.cond:  # every group the lag rule admits is running on version 0
            assert servers.cond.wait_for(lambda: servers.first_calls == 2 * B, timeout=BOUND_S)
        with ar.paused(1):
            servers.version = 1
        deadline = time.monotonic() + BOUND_S  # a group that never completes fails the take, not hangs
        kept, metrics, _, _ = ar.take_step(1, stop_check=lambda: time.monotonic() > deadline)
    finally:
        ar.close()
    budget = rt.cfg.rollout.max_response_length
    for i in range(len(kept)):
        tokens = kept.response_ids[i].tolist()
        assert len(tokens) == budget and tokens == [tokens[0] + j for j in range(budget)]  # one response
        assert kept.prompt_ids[i].tolist() + tokens[:FIRST] in [list(x) for x in servers.resumed_inputs]
    assert finished[:B] == [(0, 1)] * B  # the first tokens on version 0, the rest on 1
    assert len(kept) == B * N and metrics["rollout/staleness_max"] == 0.0
