"""Over-sampling with partial rollouts (training/partial_rollouts.py) on a scripted engine whose
outcome does not depend on thread timing: no group dropped or trained incomplete, no prompt lost or
repeated, resumed rows continue the same response, per-token versions and the mask_prefix loss
mask, batches in a deterministic order, an exact resume with partial responses in the pool, and
over-sampling off leaving the synchronous rollout as it was.

Mutations tried (each fails the test named): resuming from the prompt alone (`row_requests` without
the partial tokens): `test_resumed_rows_continue_the_same_response`; tagging resumed tokens with
the group's first version: `test_versions_and_mask_prefix`; dropping the surplus complete groups
(`pool.groups` without them after `dyn.take`): `test_no_group_dropped_no_prompt_lost`; leaving
`partial_rollouts` out of `RLState.state_dict`: `test_exact_resume_with_partials_in_the_pool`;
dispatching on ``over_sampling >= 1``: `test_over_sampling_off_is_the_synchronous_rollout`."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from hapo_megatron.training import partial_rollouts
from hapo_megatron.training.batches.micro_batches import collate
from hapo_megatron.training.batches.rollout_share import RankBatch
from hapo_megatron.training.partial_rollouts import PartialPool
from hapo_megatron.rollout.sglang.requests import group_payload, parse_row
from tests.rollout.standin_engine import StandInEngine
from tests.tools._load import load_tool

B, N, MAX_LEN, CHUNK = 2, 3, 16, 6  # groups per batch, rows per group, token budget, tokens per round
LONG = 20  # a long row's length (capped at MAX_LEN): it needs three rounds


def prompt_index(ids) -> int:
    """The dataset index of a prompt of the bench's dataset ([1, 3 + i % 29, 3 + i // 29])."""
    return (ids[1] - 3) + 29 * (ids[2] - 3)


def full_length(ids, seed: int) -> int:
    """Every third prompt's rows are long; the others' 1-4 tokens (by the row's seed)."""
    return LONG if prompt_index(ids) % 3 == 0 else 1 + seed % 4


def token(seed: int, pos: int) -> int:
    return 3 + (seed // 7 + 5 * pos) % 37


def expected_response(ids, seed: int) -> list[int]:
    """What a row generated without interruption would be (the budget caps it)."""
    return [token(seed, j) for j in range(min(full_length(ids, seed), MAX_LEN))]


class ScriptedServers(StandInEngine):
    """``engine.generate_group`` / ``engine.abort_requests`` of one round: the calls wait until
    all of the round have arrived; a row with at most CHUNK tokens left finishes; a call with a
    longer row waits for the round's outcome: an abort (then such rows return CHUNK tokens, finish
    reason abort), or, when the round's other calls are done and nobody aborted, every row finishes.
    A row continues from its input (prompt + partial response), its tokens a function of (seed,
    position)."""

    send_sampling_seed = True

    def __init__(self):
        self.cond = threading.Condition()
        self.aborts = 0
        self.expected = self.arrived = self.short_calls = self.short_done = 0
        self.outcome = None  # the round's: "abort" or "finish", whichever comes first
        self.inputs = []
        self.version = 0  # the weight version the test says the servers hold
        self.emitted = {}  # (seed, position) -> the version it was returned under

    def begin_round(self, calls: int) -> None:
        with self.cond:
            self.expected, self.arrived, self.short_calls, self.short_done = calls, 0, 0, 0
            self.outcome = None

    def _decide(self, abort: bool = False) -> None:
        if self.outcome is None and self.arrived >= self.expected:
            if abort:
                self.outcome = "abort"
            elif self.short_done >= self.short_calls:
                self.outcome = "finish"
        self.cond.notify_all()

    def short_call_done(self) -> None:
        with self.cond:
            self.short_done += 1
            self._decide()

    def _plan(self, ids, sp):
        pos = len(ids) - 3
        seed = sp["sampling_seed"]
        left = min(full_length(ids[:3], seed) - pos, int(sp["max_new_tokens"]))
        reason = "stop" if full_length(ids[:3], seed) - pos <= int(sp["max_new_tokens"]) else "length"
        return [token(seed, pos + j) for j in range(left)], [-0.01 * (pos + j + 1) for j in range(left)], reason

    def generate_group(self, rows, params):
        """The group's body as the SGLang engine sends it, answered as the script says, parsed as
        the SGLang engine parses it."""
        return [parse_row(item) for item in self._answer(group_payload(rows, params))]

    def _answer(self, body):
        plans = [self._plan(ids, sp) for ids, sp in zip(body["input_ids"], body["sampling_params"])]
        long = any(len(t) > CHUNK for t, _, _ in plans)
        with self.cond:
            self.inputs.append([list(ids) for ids in body["input_ids"]])
            self.arrived += 1
            self.short_calls += int(not long)
            self._decide()
            self.cond.wait_for(lambda: self.arrived >= self.expected)
            if long:
                self.cond.wait_for(lambda: self.outcome is not None)
            aborted = self.outcome == "abort"
        out = []
        sp_seeds = [(sp["sampling_seed"], len(ids) - 3) for ids, sp in zip(body["input_ids"], body["sampling_params"])]
        for toks, lps, reason in plans:
            if aborted and len(toks) > CHUNK:
                toks, lps, reason = toks[:CHUNK], lps[:CHUNK], "abort"
            seed, pos = sp_seeds.pop(0)
            for j in range(len(toks)):
                self.emitted[(seed, pos + j)] = self.version
            out.append({"output_ids": toks, "meta_info": {"finish_reason": {"type": reason},
                                                         "output_token_logprobs": [[lp, t, None]
                                                                                   for lp, t in zip(lps, toks)]}})
        return out

    def abort_requests(self):
        with self.cond:
            self.aborts += 1
            self._decide(abort=True)


@pytest.fixture
def scripted(monkeypatch):
    """Every `generate_groups` of the rollout told to the scripted servers (the round's size; a
    group's answer handled, after any abort it caused)."""
    real = partial_rollouts.generate_groups

    def wrapped(engine, groups, params, on_group, **kw):
        engine.begin_round(len(groups))

        def told(i, res):
            enough = on_group(i, res)
            if enough:
                engine.abort_requests()  # before the waiting calls hear that this one is done
            if all(r.finish_reason != "abort" for r in res):
                engine.short_call_done()
            return enough
        return real(engine, groups, params, told, **kw)
    monkeypatch.setattr(partial_rollouts, "generate_groups", wrapped)


def _rt(over_sampling=3.0, partial_mode="correct", filter_groups=False):
    bench = load_tool("bench/oversampling")
    return bench.build_rt(None, over_sampling=over_sampling, batch=B, n=N, max_len=MAX_LEN, prompts=120,
                          partial_mode=partial_mode, filter_groups=filter_groups, engine=ScriptedServers())


def _steps(rt, first, last):
    bench = load_tool("bench/oversampling")
    return bench.run_steps(rt, last - first + 1, first_step=first)


def _row_seed(rt, serial, k):
    from hapo_megatron.rollout.engine import SamplingParams
    from hapo_megatron.rollout.sglang.engine import row_seeds
    return row_seeds(SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, seed=rt.sampling_seed(0, 0)),
                     [serial * N + k])[0]


def test_no_group_dropped_no_prompt_lost(scripted):
    rt = _rt()
    got = _steps(rt, 1, 6)
    trained = [int(g) for r in got for g in dict.fromkeys(r["kept"].group_ids)]
    pool = PartialPool.from_dict(rt.rl.partial_rollouts)
    left = [g.serial for g in pool.groups]
    # every group started is trained once or still in the pool: serials 0 .. next_serial - 1
    assert sorted(trained + left) == list(range(pool.next_serial))
    assert len(set(trained)) == len(trained) == 6 * B
    for r in got:
        kept = r["kept"]
        assert len(kept) == B * N and set(kept.finish_reasons) <= {"stop", "length"}
        counts = np.unique(kept.group_ids, return_counts=True)[1]
        assert (counts == N).all()  # whole groups
    # the prompts: trained + pool + queue = what the sampler drew, in order
    from hapo_megatron.data.sampler import PromptSampler
    drawn = PromptSampler(rt.train_ds, B, seed=1, shuffle=True)
    used = sorted(trained + left)
    prompts = {int(g): prompt_index(r["kept"].prompt_ids[i]) for r in got
               for i, g in enumerate(r["kept"].group_ids)}
    prompts.update({g.serial: g.prompt_index for g in pool.groups})
    order = [prompts[s] for s in used] + pool.queue
    expect = []
    while len(expect) < len(order):
        expect += drawn.next_indices()
    assert order == expect[:len(order)]
    assert any(r["metrics"]["rollout/aborted"] for r in got) and any(r["metrics"]["rollout/resumed"] for r in got)


def test_resumed_rows_continue_the_same_response(scripted):
    rt = _rt()
    got = _steps(rt, 1, 6)
    resumed_inputs = [ids for call in rt.engine.inputs for ids in call if len(ids) > 3]
    assert resumed_inputs  # some rows did resume
    for r in got:
        kept = r["kept"]
        for i, g in enumerate(kept.group_ids):
            k = i % N
            ids = kept.prompt_ids[i].tolist()
            seed = _row_seed(rt, int(g), k)
            assert kept.response_ids[i].tolist() == expected_response(ids, seed)
            n_tok = len(kept.response_ids[i])
            assert np.allclose(kept.rollout_logprobs[i], [-0.01 * (j + 1) for j in range(n_tok)])
            long = full_length(ids, seed) > MAX_LEN
            assert kept.finish_reasons[i] == ("length" if long else "stop")


def test_versions_and_mask_prefix(scripted):
    rt = _rt(partial_mode="mask_prefix")
    got = []
    for step in range(1, 7):
        rt.engine.version = step - 1  # the synchronous loop's rollout of step k runs on version k - 1
        got += _steps(rt, step, step)
    older_seen = False
    for step, r in enumerate(got, start=1):
        kept, version = r["kept"], step - 1
        mask = kept.column("token_mask")
        assert (mask.lengths == kept.response_lengths).all()
        for i, g in enumerate(kept.group_ids):
            seed = _row_seed(rt, int(g), i % N)
            versions = [rt.engine.emitted[(seed, j)] for j in range(len(kept.response_ids[i]))]
            assert mask[i].tolist() == [1.0 if v == version else 0.0 for v in versions]
            older_seen |= any(v < version for v in versions)
        rb = RankBatch.whole(kept, plans=[])  # only its sequences are read here
        mb = collate([rb.sequence(i, 1.0) for i in range(len(kept))])
        for i in range(len(kept)):
            p, n_tok = len(kept.prompt_ids[i]), len(kept.response_ids[i])
            assert mb.loss_mask[i, p - 1:p - 1 + n_tok].tolist() == mask[i].tolist()
            assert float(mb.loss_mask[i].sum()) == float(mask[i].sum())
        older = sum(int((np.asarray(mask[i]) == 0).sum()) for i in range(len(kept)))
        assert r["metrics"]["rollout/older_version_token_frac"] == pytest.approx(older / kept.response_lengths.sum())
    assert older_seen


def test_batches_in_deterministic_order(scripted):
    a, b = _steps(_rt(), 1, 5), _steps(_rt(), 1, 5)
    for x, y in zip(a, b):
        assert x["kept"] == y["kept"]
        gids = list(dict.fromkeys(x["kept"].group_ids))
        assert gids == sorted(gids)  # admission order


def test_exact_resume_with_partials_in_the_pool(scripted):
    whole = _steps(_rt(), 1, 8)
    rt = _rt()
    _steps(rt, 1, 6)
    state = json.loads(json.dumps(rt.rl.state_dict()))  # what rl_state.json keeps
    pool = PartialPool.from_dict(state["partial_rollouts"])
    assert any(not g.complete and g.rows[0].tokens for g in pool.groups)  # a partial response
    resumed = _rt()
    resumed.rl.load_state_dict(state)
    later = _steps(resumed, 7, 8)
    assert later[-1]["metrics"]["rollout/resumed"] > 0
    for x, y in zip(whole[6:], later):
        assert x["kept"] == y["kept"]
        timeless = [{k: v for k, v in m["metrics"].items() if not k.startswith("timing/")} for m in (x, y)]
        assert timeless[0] == timeless[1]


class SyncOnly(StandInEngine):
    """Whole groups from `generate` (a call counted in ``log``); `generate_group` refuses."""

    def __init__(self, log):
        self.log = log

    def generate(self, prompt_ids, params, on_samples=None):
        from hapo_megatron.rollout.engine import Sample
        self.log.append(1)
        return [[Sample(prompt_ids=p, response_ids=[5, 6], rollout_logprobs=[-1.0, -1.0], temperatures=[],
                        finish_reason="stop", prompt_index=i, sample_index=k) for k in range(params.n)]
                for i, p in enumerate(prompt_ids)]


def test_over_sampling_off_is_the_synchronous_rollout(monkeypatch):
    rt = _rt(over_sampling=1.0)

    def refuse(*a, **kw):
        raise AssertionError("over-sampling off must not reach partial_rollouts")
    monkeypatch.setattr(partial_rollouts, "rollout_rank0", refuse)
    calls = []
    rt.engine = SyncOnly(calls)
    got = _steps(rt, 1, 2)
    assert calls and "partial_rollouts" not in rt.rl.state_dict()
    assert not any(k in got[0]["metrics"] for k in ("rollout/aborted", "rollout/resumed"))


SGLANG = ["rollout.engine=sglang", "rollout.sglang.colocate=false"]


@pytest.mark.parametrize("overrides,message", [
    (SGLANG + ["rollout.over_sampling=0.9"], r"rollout\.over_sampling"),
    (["rollout.over_sampling=1.5"], r"rollout\.over_sampling=1\.5 .*rollout\.engine=sglang"),
    (SGLANG + ["rollout.partial_mode=drop"], r"rollout\.partial_mode"),
    (SGLANG + ["rollout.over_sampling=1.5", "algo.rollout_is=none"], r"partial_mode=correct .*algo\.rollout_is"),
    (SGLANG + ["rollout.over_sampling=1.5", "model.routing_replay=true"], r"model\.routing_replay"),
])
def test_config_refusals_name_the_field(overrides, message):
    from hapo_megatron.config import load_config
    with pytest.raises(ValueError, match=message):
        load_config(overrides=overrides)


def test_over_sampling_with_asynchronous_rollouts_is_accepted():
    from hapo_megatron.config import load_config
    cfg = load_config(overrides=SGLANG + ["rollout.over_sampling=1.5", "rollout.max_staleness=1"])
    assert cfg.rollout.over_sampling == 1.5 and cfg.algo.loss.rollout_is == "token_tis"


def test_config_correct_turns_the_correction_on():
    from hapo_megatron.config import load_config
    assert load_config(overrides=SGLANG + ["rollout.over_sampling=1.5"]).algo.loss.rollout_is == "token_tis"
    masked = load_config(overrides=SGLANG + ["rollout.over_sampling=1.5", "rollout.partial_mode=mask_prefix"])
    assert masked.algo.loss.rollout_is == "none"
    assert load_config(overrides=SGLANG).algo.loss.rollout_is == "none"  # over-sampling off: as before


EOS, OTHER_STOP = 2, 1
PROMPT_LEN = 3  # the bench's prompts: [1, a, b]


class AbortedAtTheEnd(StandInEngine):
    """A stand-in server whose every call comes back aborted; row 0 of each group in the decode
    step that sampled the EOS (the EOS its last token, as SGLang returns it), the other rows
    after two tokens of a longer response. Records every request's inputs."""

    send_sampling_seed = True

    def __init__(self):
        self.inputs = []

    def generate_group(self, rows, params):
        """The group's body as the SGLang engine sends it, answered as above, parsed as the SGLang
        engine parses it."""
        out = []
        for k, ids in enumerate(group_payload(rows, params)["input_ids"]):
            self.inputs.append(list(ids))
            toks = [40, EOS] if k == 0 and len(ids) == PROMPT_LEN else [41, 42]  # row 0 on its first call
            out.append({"output_ids": toks, "meta_info": {"finish_reason": {"type": "abort"},
                                                         "output_token_logprobs": [[-0.5, t, None] for t in toks]}})
        return [parse_row(item) for item in out]


def test_a_row_aborted_with_its_eos_last_is_complete_and_not_resumed():
    """Fails without the stop check in `PartialRow.extend` (tried): row 0 is resumed with its
    EOS in the input, and its response grows past the EOS."""
    bench = load_tool("bench/oversampling")
    engine = AbortedAtTheEnd()
    rt = bench.build_rt(None, over_sampling=1.0 + 1e-9, batch=1, n=2, max_len=6, prompts=20, engine=engine)
    rt.tokenizer.eos_token_id = EOS
    (result,) = bench.run_steps(rt, 1)
    assert engine.inputs and all(EOS not in ids[PROMPT_LEN:] for ids in engine.inputs), engine.inputs
    kept = result["kept"]
    assert len(kept) == 2  # one group of n=2: row 1 resumed to the budget (length), row 0 ended at once
    assert list(kept.response_ids[0]) == [40, EOS] and kept.finish_reasons[0] == "stop"
    assert list(kept.response_ids[1]) == [41, 42] * 3 and kept.finish_reasons[1] == "length"


@pytest.mark.parametrize("stop_ids,finish", [((EOS,), "stop"), ((EOS, OTHER_STOP), "stop"), ((), None)])
def test_row_extend_stops_on_any_stop_token(stop_ids, finish):
    from hapo_megatron.rollout.sglang.partial import RowResult
    from hapo_megatron.training.partial_rollouts import PartialRow

    row = PartialRow()
    row.extend(RowResult((40, OTHER_STOP if OTHER_STOP in stop_ids else EOS), (-0.1, -0.2), "abort"), 0, 16,
               stop_ids)
    assert row.finish == finish
    mid = PartialRow()  # a stop token inside the response, not last: still unfinished
    mid.extend(RowResult((EOS, 40), (-0.1, -0.2), "abort"), 0, 16, (EOS,))
    assert mid.finish is None
