"""rollout/sglang/partial.py without a server: SGLang's answers for aborted requests (a running one
keeps its tokens, a queued one has none), the per-row token budgets of a group's body, and the
abort of everything in flight after a failure or a stop request.

Mutations tried: `parse_row` refusing finish reason abort fails
`test_parse_row_keeps_an_aborted_rows_tokens`; `group_payload` leaving every row at the params'
budget fails `test_group_payload_gives_each_row_its_budget`; `generate_groups` without the abort
after a failure fails `test_a_failure_aborts_the_calls_in_flight`."""

import threading

import pytest

from hapo_megatron.rollout.engine import GenerationAborted, SamplingParams
from hapo_megatron.rollout.sglang.client import SGLangError
from hapo_megatron.rollout.sglang.partial import ABORT, RowRequest, generate_groups, group_payload, parse_row
from tests.rollout.standin_engine import StandInEngine


def answer(ids, reason, logprobs=True, status=None):
    meta = {"finish_reason": {"type": reason, "message": "Aborted", "status_code": status}}
    if logprobs:
        meta["output_token_logprobs"] = [[-0.5 * (i + 1), t, None] for i, t in enumerate(ids)]
    return {"output_ids": list(ids), "meta_info": meta}


def test_parse_row_keeps_an_aborted_rows_tokens():
    row = parse_row(answer([7, 8, 9], "abort"))
    assert row.finish_reason == ABORT and row.token_ids == (7, 8, 9) and row.logprobs == (-0.5, -1.0, -1.5)
    queued = parse_row(answer([], "abort", logprobs=False))  # aborted before its first token
    assert queued.finish_reason == ABORT and queued.token_ids == () and queued.logprobs == ()
    assert parse_row(answer([4], "length")).finish_reason == "length"
    with pytest.raises(SGLangError, match="no output_token_logprobs"):
        parse_row(answer([4], "stop", logprobs=False))
    with pytest.raises(SGLangError, match="disagree"):
        parse_row({**answer([4, 5], "stop"), "output_ids": [4]})
    with pytest.raises(SGLangError, match="finished with"):
        parse_row(answer([4], "error"))


def test_group_payload_gives_each_row_its_budget():
    rows = [RowRequest((1, 2), 10, seed=5), RowRequest((1, 2, 30, 31), 8, seed=6)]
    body = group_payload(rows, SamplingParams(max_new_tokens=10, temperature=0.7, top_p=1.0, top_k=-1))
    assert body["input_ids"] == [[1, 2], [1, 2, 30, 31]]
    assert [sp["max_new_tokens"] for sp in body["sampling_params"]] == [10, 8]
    assert [sp["sampling_seed"] for sp in body["sampling_params"]] == [5, 6]
    assert body["return_logprob"] is True


class FakeEngine(StandInEngine):
    """The first call fails and the others finish (or, with ``fail=False``, every call waits for an
    abort); counts the aborts."""

    def __init__(self, fail=True):
        self.fail = fail
        self.aborted = threading.Event()
        self.aborts = 0
        self.first = threading.Lock()
        self.failed = False

    def generate_group(self, rows, params):
        if self.fail:
            with self.first:
                first, self.failed = not self.failed, True
            if first:
                raise SGLangError("server said no")
            return [parse_row(answer([3], "length")) for _ in rows]
        self.aborted.wait()
        return [parse_row(answer([3], "abort")) for _ in rows]

    def abort_requests(self):
        self.aborts += 1
        self.aborted.set()


def test_a_failure_aborts_the_calls_in_flight():
    eng = FakeEngine()
    rows = [[RowRequest((1,), 4)] for _ in range(3)]
    with pytest.raises(SGLangError, match="server said no"):
        generate_groups(eng, rows, [SamplingParams(temperature=1.0, top_p=1.0, top_k=-1)] * 3, lambda g, res: False)
    assert eng.aborts == 1


def test_a_stop_request_aborts_and_raises():
    eng = FakeEngine(fail=False)
    rows = [[RowRequest((1,), 4)] for _ in range(2)]
    with pytest.raises(GenerationAborted):
        generate_groups(eng, rows, [SamplingParams(temperature=1.0, top_p=1.0, top_k=-1)] * 2, lambda g, res: False,
                        stop_check=lambda: True)
    assert eng.aborts == 1
