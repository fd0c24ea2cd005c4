"""EDGE-GRPO's guided error correction (training/guided_correction.py; docs/algorithm.md,
"EDGE-GRPO"): a hand-computed round per branch, a text-level reference (the authors' string
operations on decoded responses) over random rounds, the branch draw's law and purity, the
refusals, and the wiring from the config through rank 0's rollout (each knob changes what the
engine is asked or what the batch holds)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from hapo_megatron.config import AlgoConfig, HapoConfig, load_config
from hapo_megatron.rewards.scoring import RewardScorer
from hapo_megatron.rollout.engine import Sample
from hapo_megatron.training import stages
from hapo_megatron.training.batches.rollout_batch import DynamicSampler
from hapo_megatron.training.guided_correction import (HINT, REFLECT, SOLUTION, GecCounts, branch_of,
                                                      continuation_seed, correct_round)
from hapo_megatron.training.memory.engine_memory import EngineMemory
from tests.rollout.standin_engine import StandInEngine

EOS = 0  # the tests' stop token; every other id is a character's code point


def enc(text: str) -> list[int]:
    return [ord(c) for c in text]


def dec(ids) -> str:
    return "".join(chr(int(i)) for i in ids if int(i) != EOS)


def smp(text: str, p: int, k: int, *, stop: bool = True, prompt: str = "Q") -> Sample:
    ids = enc(text) + ([EOS] if stop else [])
    return Sample(prompt_ids=enc(prompt), response_ids=ids, rollout_logprobs=[-0.5] * len(ids),
                  temperatures=[1.0] * len(ids), finish_reason="stop" if stop else "length",
                  prompt_index=p, sample_index=k)


def res(acc: bool) -> SimpleNamespace:
    return SimpleNamespace(acc=acc, score=1.0 if acc else -1.0)


def score_text(text: str, truth: str) -> SimpleNamespace:
    """The tests' reward: the text after the last "Answer:" equals the truth."""
    return res(text.rsplit("Answer:", 1)[-1].strip() == truth if "Answer:" in text else False)


def score_fn(samples, records):
    return [[score_text(dec(s.response_ids), r.ground_truth) for s in group] for group, r in zip(samples, records)]


def rec(truth: str, solution=None) -> SimpleNamespace:
    return SimpleNamespace(ground_truth=truth, data_source="d", extra_info={"solution": solution} if solution else {})


def algo(**kw) -> AlgoConfig:
    return AlgoConfig.from_dict({"edge_gec": True, "edge_gec_hint": "\nAnswer: {answer}", **kw})


class Continuer:
    """Scripted policy continuation: ``text`` for every input; records the calls."""

    def __init__(self, text: str = " so Answer: 8", stop: bool = True):
        self.text, self.stop, self.calls = text, stop, []

    def __call__(self, inputs, max_new_tokens):
        self.calls.append((inputs, max_new_tokens))
        ids = (enc(self.text) + ([EOS] if self.stop else []))[:max_new_tokens]
        return [Sample(prompt_ids=x, response_ids=ids, rollout_logprobs=[-0.25] * len(ids), temperatures=[],
                       finish_reason="stop" if self.stop and len(ids) == len(self.text) + 1 else "length",
                       prompt_index=j) for j, x in enumerate(inputs)]


def run(samples, results, records, cfg, *, max_len=64, seed=7, cont=None, counts=None):
    counts = counts if counts is not None else GecCounts()
    out = correct_round(samples, results, records, algo=cfg, seed=seed, max_response_length=max_len,
                        stop_ids=[EOS], encode=enc, continue_fn=cont or Continuer(), score_fn=score_fn,
                        counts=counts)
    return out, counts


# ------------------------------------------------------------------ hand-computed, one branch each


def test_hint_branch_hand_computed():
    samples = [[smp("Answer: 7", 0, 0), smp("Answer: 8", 0, 1)]]
    results = [[res(False), res(True)]]
    (out, out_res), counts = run(samples, results, [rec("8")], algo(edge_gec_reflect_prob=0.0,
                                                                     edge_gec_solution_prob=0.0))
    fixed = out[0][0]
    assert fixed.response_ids.tolist() == enc("Answer: 7") + enc("\nAnswer: 8") + [EOS]  # stop token moved last
    assert fixed.rollout_logprobs.tolist() == [-0.5] * 9 + [0.0] * 11  # inserted: no engine log-prob
    assert len(fixed.temperatures) == 0 and fixed.finish_reason == "stop"
    assert (fixed.prompt_index, fixed.sample_index) == (0, 0)
    assert out[0][1] is samples[0][1] and out_res[0][0].acc and out_res[0][1].acc
    assert samples[0][0].response_ids.tolist() == enc("Answer: 7") + [EOS]  # the input is not changed
    assert counts.metrics() == {"gec/wrong_frac": 0.5, "gec/corrected_frac": 0.5, "gec/reflect_frac": 0.0,
                                "gec/hint_frac": 0.5, "gec/solution_frac": 0.0, "gec/skipped_frac": 0.0,
                                "gec/solution_missing": 0.0, "gec/fixed_frac": 1.0, "gec/reflect_fixed_frac": 0.0}


def test_solution_branch_and_its_fallback_hand_computed():
    samples = [[smp("Answer: 1", 0, 0)], [smp("Answer: 2", 1, 0, stop=False)]]
    results = [[res(False)], [res(False)]]
    records = [rec("5", solution="2 + 3 = 5\nAnswer: 5"), rec("6")]  # the second row has no solution
    (out, out_res), counts = run(samples, results, records, algo(edge_gec_reflect_prob=0.0,
                                                                 edge_gec_solution_prob=1.0))
    assert out[0][0].response_ids.tolist() == enc("2 + 3 = 5\nAnswer: 5") + [EOS]
    assert out[0][0].rollout_logprobs.tolist() == [0.0] * 20
    # no solution: the answer hint instead; a truncated response has no stop token to drop
    assert out[1][0].response_ids.tolist() == enc("Answer: 2") + enc("\nAnswer: 6") + [EOS]
    assert (counts.solution, counts.hint, counts.solution_missing, counts.fixed) == (1, 1, 1, 2)


def test_reflect_branch_hand_computed():
    samples = [[smp("Answer: 7", 0, 0, prompt="P")]]
    cont = Continuer(" so Answer: 8")
    (out, out_res), counts = run(samples, [[res(False)]], [rec("8")], algo(edge_gec_reflect_prob=1.0,
                                                                           edge_gec_cue=" Wait!",
                                                                           edge_gec_max_new_tokens=50), cont=cont)
    # the policy continues prompt + response without its stop token + cue, at the configured budget
    assert cont.calls == [([enc("P") + enc("Answer: 7") + enc(" Wait!")], 50)]
    assert out[0][0].response_ids.tolist() == enc("Answer: 7 Wait! so Answer: 8") + [EOS]
    assert out[0][0].rollout_logprobs.tolist() == [-0.5] * 9 + [0.0] * 6 + [-0.25] * 14
    assert out[0][0].finish_reason == "stop" and out_res[0][0].acc
    assert (counts.reflect, counts.reflect_fixed) == (1, 1)


@pytest.mark.parametrize("reflect_prob, expected", [(1.0, " Wait! so Answer: 8"), (0.0, "\nAnswer: 8")])
def test_an_empty_response_is_corrected_and_its_stop_token_leaves_the_batch(reflect_prob, expected):
    """A response that stops at once is wrong, so it is always corrected, and the correction starts
    where its stop token was: the stop at the first position never enters the loss (the authors'
    code decodes the response with special tokens skipped and appends to the empty text;
    docs/algorithm.md, "EDGE-GRPO on the CPU task")."""
    samples = [[smp("", 0, 0)]]
    assert samples[0][0].response_ids.tolist() == [EOS]
    (out, _), counts = run(samples, [[res(False)]], [rec("8")],
                           algo(edge_gec_reflect_prob=reflect_prob, edge_gec_solution_prob=0.0,
                                edge_gec_cue=" Wait!"))
    assert out[0][0].response_ids.tolist() == enc(expected) + [EOS]
    assert counts.metrics()["gec/corrected_frac"] == 1.0


def test_reflect_is_cut_at_the_response_limit_and_too_long_corrections_are_skipped():
    samples = [[smp("Answer: 7", 0, 0), smp("Answer: 777777", 0, 1)]]
    cfg = algo(edge_gec_reflect_prob=1.0, edge_gec_cue=" Wait!")
    # 9 + 6 = 15 tokens of prefix; a limit of 20 leaves 5 for the continuation; the second
    # response (14 + 6 + 1 > 20) has no room for a single new token: skipped, kept as it was
    (out, out_res), counts = run(samples, [[res(False), res(False)]], [rec("8")], cfg, max_len=20)
    assert out[0][0].response_ids.tolist() == enc("Answer: 7 Wait! so A")
    assert out[0][0].finish_reason == "length" and not out_res[0][0].acc
    assert out[0][1] is samples[0][1] and counts.skipped == 1
    hint = algo(edge_gec_reflect_prob=0.0, edge_gec_solution_prob=0.0)
    (out, _), counts = run([[smp("Answer: 7", 0, 0)]], [[res(False)]], [rec("8")], hint, max_len=19)
    assert out[0][0].response_ids.tolist() == enc("Answer: 7") + [EOS] and counts.skipped == 1  # 20 > 19


# ------------------------------------------------------------------ the authors' text operations


def _reference(samples, results, records, cfg, seed, cont_text, max_len):
    """EDGE-GRPO's grpo_aha_trainer.py in text: a wrong completion (decoded without special
    tokens) gets cue + the policy's continuation, or cue-and-answer text, or becomes the
    solution; then it is rewarded again. Loops over responses one by one."""
    n = len(samples[0])
    texts, accs = [], []
    for p, group in enumerate(samples):
        for k, s in enumerate(group):
            text, acc = dec(s.response_ids), results[p][k].acc
            if not acc:
                b = branch_of(seed, p * n + k, cfg.edge_gec_reflect_prob, cfg.edge_gec_solution_prob)
                sol = records[p].extra_info.get("solution")
                if b == SOLUTION and not sol:
                    b = HINT
                new = {REFLECT: text + cfg.edge_gec_cue + cont_text,
                       HINT: text + cfg.edge_gec_hint.replace("{answer}", records[p].ground_truth),
                       SOLUTION: sol}[b]
                room = max_len - (0 if b == REFLECT else 1)  # the guided ones end with the stop token
                if len(text) + len(cfg.edge_gec_cue) + 1 <= max_len if b == REFLECT else len(new) <= room:
                    text = new[:max_len]
                    acc = score_text(text, records[p].ground_truth).acc
            texts.append(text)
            accs.append(acc)
    return texts, accs


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_matches_the_text_level_reference_on_random_rounds(seed):
    rng = np.random.default_rng(seed)
    records, samples, results = [], [], []
    for p in range(6):
        truth = str(int(rng.integers(0, 10)))
        records.append(rec(truth, solution=f"x = {truth}\nAnswer: {truth}" if p % 3 else None))
        group = []
        for k in range(4):
            answer = str(int(rng.integers(0, 10))) * int(rng.integers(1, 12))
            group.append(smp(f"Answer: {answer}", p, k, stop=bool(rng.integers(0, 2))))
        samples.append(group)
        results.append([score_fn([[s]], [records[p]])[0][0] for s in group])
    cfg = algo(edge_gec_cue=" Wait!", edge_gec_reflect_prob=0.4, edge_gec_solution_prob=0.6)
    (out, out_res), counts = run(samples, results, records, cfg, max_len=30, seed=seed * 11,
                                 cont=Continuer(" Answer: 3", stop=False))
    texts, accs = _reference(samples, results, records, cfg, seed * 11, " Answer: 3", 30)
    assert [dec(s.response_ids) for g in out for s in g] == texts
    assert [r.acc for g in out_res for r in g] == accs
    assert counts.wrong == sum(not r.acc for g in results for r in g) > 0
    assert counts.reflect and counts.hint and counts.solution  # every branch ran


# ------------------------------------------------------------------ the draw


def test_branch_law_and_purity():
    draws = [branch_of(5, i, 0.5, 0.5) for i in range(8000)]
    for branch, p in ((REFLECT, 0.5), (HINT, 0.25), (SOLUTION, 0.25)):
        share = draws.count(branch) / len(draws)
        assert abs(share - p) < 5 * (p * (1 - p) / len(draws)) ** 0.5, (branch, share)
    # a response's branch is a function of (seed, position) only: the same whatever else is in
    # the round, and another seed draws anew
    assert [branch_of(5, i, 0.5, 0.5) for i in (17, 3, 17)] == [draws[17], draws[3], draws[17]]
    assert [branch_of(6, i, 0.5, 0.5) for i in range(64)] != draws[:64]
    assert {branch_of(5, i, 1.0, 0.0) for i in range(64)} == {REFLECT}
    assert continuation_seed(5) not in {5, 6, 7} and continuation_seed(5) == continuation_seed(5)


def test_a_correction_does_not_depend_on_the_other_responses():
    cfg = algo(edge_gec_reflect_prob=0.0, edge_gec_solution_prob=0.5)
    samples = [[smp("Answer: 1", 0, k) for k in range(4)] for _ in range(3)]
    records = [rec("2", solution="y\nAnswer: 2") for _ in range(3)]
    (all_wrong, _), _ = run(samples, [[res(False)] * 4] * 3, records, cfg)
    mixed = [[res(k != 1 or p != 2) for k in range(4)] for p in range(3)]  # only (2, 1) wrong
    (one_wrong, _), _ = run(samples, mixed, records, cfg)
    assert one_wrong[2][1].response_ids.tolist() == all_wrong[2][1].response_ids.tolist()


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("changes, message", [
    (dict(edge_gec_reflect_prob=1.5), "algo.edge_gec_reflect_prob must be in [0, 1], got 1.5"),
    (dict(edge_gec_solution_prob=-0.1), "algo.edge_gec_solution_prob must be in [0, 1]"),
    (dict(edge_gec_solution_prob=float("nan")), "algo.edge_gec_solution_prob must be finite"),
    (dict(edge_gec_max_new_tokens=0), "algo.edge_gec_max_new_tokens must be >= 1"),
    (dict(edge_gec_cue=""), "algo.edge_gec_cue must be a non-empty string"),
    (dict(edge_gec_hint="the answer is 5"), "algo.edge_gec_hint must contain {answer}"),
    (dict(edge_gec_solution_key=""), "algo.edge_gec_solution_key must be a non-empty string"),
])
def test_bad_values_refused_in_one_line(changes, message):
    with pytest.raises(ValueError) as info:
        AlgoConfig.from_dict(changes)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("overrides, message", [
    (["rollout.max_staleness=1", "rollout.engine=sglang", "rollout.sglang.colocate=false"],
     "algo.edge_gec corrects responses in the synchronous"),
    (["rollout.over_sampling=1.5", "rollout.engine=sglang", "rollout.partial_mode=mask_prefix"],
     "rollout.over_sampling=1.5 resumes partial ones"),
    (["algo.old_logprob_source=rollout"], "algo.old_logprob_source=rollout takes the engine's log-probs"),
    (["algo.tis_cap=2.0"], "algo.rollout_is / algo.tis_cap weight tokens"),
    (["algo.rollout_is=token_tis"], "algo.rollout_is / algo.tis_cap weight tokens"),
    (["model.routing_replay=true"], "model.routing_replay reads the engine's MoE routes"),
    (["model.measure_routing_mismatch=true"], "model.measure_routing_mismatch reads"),
])
def test_combinations_that_need_engine_values_refused(overrides, message):
    with pytest.raises(ValueError) as info:
        load_config(preset="edge-grpo", overrides=overrides)
    assert message in str(info.value) and "\n" not in str(info.value)
    load_config(preset="edge-grpo", overrides=overrides + ["algo.edge_gec=false"])  # fine without GEC


# ------------------------------------------------------------------ wiring through rank 0's rollout


class _Engine(StandInEngine):
    """First call: prompt ``p``'s responses answer ``p``, ``p``, 9, 9 (two wrong when the truth is
    ``p``); later calls (the reflections' continuations): " Answer: <truth>" from the prompt's
    first character."""

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, params, on_samples=None):
        self.calls.append((prompt_ids, params))
        out = []
        for i, prompt in enumerate(prompt_ids):
            if len(self.calls) == 1:
                texts = [f"Answer: {i}", f"Answer: {i}", "Answer: 9", "Answer: 9"][:params.n]
            else:
                texts = [f" Answer: {chr(prompt[0])}"]
            ids = [(enc(t) + [EOS])[:params.max_new_tokens] for t in texts]
            out.append([Sample(prompt_ids=prompt, response_ids=x, rollout_logprobs=[-1.0] * len(x), temperatures=[],
                               finish_reason="stop" if x[-1] == EOS else "length", prompt_index=i, sample_index=k)
                        for k, x in enumerate(ids)])
        return out


def _runtime(engine, overrides=(), *, preset="edge-grpo"):
    cfg = load_config(preset=preset, overrides=[
        "data.train_batch_size=2", "trainer.ppo_mini_batch_size=2", "rollout.n=4", "rollout.max_response_length=64",
        "algo.adaptive_temperature=false", "reward.num_workers=0", "reward.reward_fn=math",
        'algo.edge_gec_hint="\\nAnswer: {answer}"', *overrides])
    records = [SimpleNamespace(prompt_ids=enc(str(p)), ground_truth=str(p), data_source="d",
                               extra_info={"solution": f"Answer: {p}"}) for p in range(2)]
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens: dec(ids), eos_token_id=EOS,
                          encode=lambda text, add_special_tokens: enc(text))
    return SimpleNamespace(
        cfg=cfg, engine=engine, memory=EngineMemory(engine), actor=SimpleNamespace(routing="off"),
        control=SimpleNamespace(send=lambda kind, body: None), sampling_seed=lambda step, i: 1000 * step + i,
        tokenizer=tok, scorer=RewardScorer(cfg.reward),
        rl=SimpleNamespace(dyn=DynamicSampler(enabled=cfg.algo.filter_groups, max_num_gen_batches=1, metric="acc"),
                           sampler=SimpleNamespace(next_batch=lambda: records, state_dict=lambda: {}),
                           rollout_entropy_stats=None))


def _texts(batch):
    return [dec(batch.response_ids[i]) for i in range(len(batch))]


def test_the_preset_corrects_wrong_responses_in_the_rollout(monkeypatch):
    monkeypatch.setattr(stages, "broadcast_object", lambda obj: obj)
    kept, metrics, _ = stages.generate_step(_runtime(_Engine()), 1)
    # prompt 0: "Answer: 0" x2 right, "Answer: 9" x2 wrong; prompt 1: ... every wrong one corrected
    assert metrics["gec/wrong_frac"] == 0.5 and metrics["gec/corrected_frac"] == 0.5
    assert metrics["gec/fixed_frac"] == 1.0 and all(kept.accs)
    off_kept, off_metrics, _ = stages.generate_step(_runtime(_Engine(), ["algo.edge_gec=false"]), 1)
    assert not any(k.startswith("gec/") for k in off_metrics) and sum(off_kept.accs) == 4
    assert _texts(off_kept) != _texts(kept)


def test_each_knob_reaches_the_rollout(monkeypatch):
    monkeypatch.setattr(stages, "broadcast_object", lambda obj: obj)

    def rollout(*overrides):
        engine = _Engine()
        kept, metrics, _ = stages.generate_step(_runtime(engine, list(overrides)), 3)
        return engine, _texts(kept), metrics
    # reflection: the cue and the budget reach the continuation call, with its own seed
    engine, texts, metrics = rollout("algo.edge_gec_reflect_prob=1.0", 'algo.edge_gec_cue=" Hmm."',
                                     "algo.edge_gec_max_new_tokens=7")
    (_, first), (inputs, params) = engine.calls
    assert params.max_new_tokens == 7 and params.n == 1 and params.seed == continuation_seed(first.seed)
    assert inputs[0] == enc("0") + enc("Answer: 9 Hmm.") and "Answer: 9 Hmm. Answer" in texts  # cut at 7 tokens
    assert metrics["gec/reflect_frac"] == 0.5
    # the answer hint with its text; the solution from its key
    _, texts, metrics = rollout("algo.edge_gec_reflect_prob=0.0", "algo.edge_gec_solution_prob=0.0",
                                "algo.edge_gec_hint='. Answer: {answer}'")
    assert "Answer: 9. Answer: 1" in texts and metrics["gec/hint_frac"] == 0.5
    _, texts, metrics = rollout("algo.edge_gec_reflect_prob=0.0", "algo.edge_gec_solution_prob=1.0")
    assert texts.count("Answer: 1") == 4 and metrics["gec/solution_frac"] == 0.5
    _, texts, metrics = rollout("algo.edge_gec_reflect_prob=0.0", "algo.edge_gec_solution_prob=1.0",
                                "algo.edge_gec_solution_key=worked")
    assert metrics["gec/solution_missing"] == 4.0 and metrics["gec/hint_frac"] == 0.5
    # the response limit bounds every correction
    _, texts, metrics = rollout("rollout.max_response_length=12", "algo.edge_gec_reflect_prob=0.0",
                                "algo.edge_gec_solution_prob=0.0")
    assert metrics["gec/skipped_frac"] == 0.5 and metrics["gec/corrected_frac"] == 0.0


def test_the_rollout_is_reproducible(monkeypatch):
    monkeypatch.setattr(stages, "broadcast_object", lambda obj: obj)
    runs = [stages.generate_step(_runtime(_Engine(), ["algo.edge_gec_reflect_prob=0.5"]), 2)[0] for _ in range(2)]
    assert runs[0] == runs[1]


def test_config_round_trip_keeps_the_knobs():
    cfg = load_config(preset="edge-grpo", overrides=['algo.edge_gec_cue=" Hmm."', "algo.edge_gec_reflect_prob=0.3"])
    again = HapoConfig.from_dict(cfg.to_dict())
    assert (again.algo.edge_gec, again.algo.edge_gec_cue, again.algo.edge_gec_reflect_prob) == (True, " Hmm.", 0.3)


@pytest.mark.parametrize("continuation,truth,acc", [("", "5", False), ("x7", "5", False),
                                                    ("Answer: 5", "5", True), ("Answer: 4", "5", False)])
def test_the_cpu_tasks_cue_leaves_its_answer_line_whole(continuation, truth, acc):
    """The CPU task's answer is the rest of its "Answer:" line, so its config's cue starts a new
    line: the reward reads the original answer, or the continuation's new one, never the cue."""
    import os

    from hapo_megatron.rewards.math import compute_score, extract_final_answer

    cfg = load_config(os.path.join(os.path.dirname(__file__), "../../examples/cpu_tiny/config.yaml"),
                      preset="edge-grpo")
    reflected = "Answer: 3" + cfg.algo.edge_gec_cue + continuation
    assert extract_final_answer(reflected) == ("3" if "Answer" not in continuation else continuation[8:])
    assert compute_score(reflected, truth, score_format="pm1").acc is acc


def test_with_the_real_hf_engine_and_character_tokenizer(monkeypatch, tmp_path):
    """The HF engine continues prompt + wrong response + cue; the character tokenizer encodes the
    cue and hint; every corrected row keeps its prompt and fits the response limit."""
    import torch

    from hapo_megatron.data import build_char_tokenizer
    from hapo_megatron.models import tiny_hf_config
    from hapo_megatron.rollout.hf_engine import HFRolloutEngine

    monkeypatch.setattr(stages, "broadcast_object", lambda obj: obj)
    tok = build_char_tokenizer(str(tmp_path / "tok"))
    torch.manual_seed(0)
    engine = HFRolloutEngine(tiny_hf_config("llama", vocab_size=len(tok)), tokenizer=tok, dtype=torch.float32)
    rt = _runtime(engine, ["rollout.max_response_length=40", 'algo.edge_gec_cue=" Wait!"',
                           "algo.edge_gec_max_new_tokens=8", "rollout.top_k=-1"])
    rt.tokenizer = tok
    records = [SimpleNamespace(prompt_ids=tok.encode(f"What is {p} + 1?", add_special_tokens=False),
                               ground_truth=str(p + 1), data_source="d",
                               extra_info={"solution": f"Answer: {p + 1}"}) for p in range(2)]
    rt.rl.sampler = SimpleNamespace(next_batch=lambda: records, state_dict=lambda: {})
    kept, metrics, _ = stages.generate_step(rt, 1)
    assert metrics["gec/wrong_frac"] == 1.0  # a random model answers nothing
    assert metrics["gec/corrected_frac"] + metrics["gec/skipped_frac"] == 1.0 and metrics["gec/corrected_frac"] > 0
    texts = [tok.decode(kept.response_ids[i], skip_special_tokens=True) for i in range(len(kept))]
    assert all(len(kept.response_ids[i]) <= 40 for i in range(len(kept)))
    reflected = [t for t in texts if " Wait!" in t and "Answer:" not in t]
    guided = [t for t in texts if t.endswith(("Answer: 1", "Answer: 2"))]
    assert len(reflected) + len(guided) == round(8 * metrics["gec/corrected_frac"])
    assert metrics["gec/fixed_frac"] == len(guided) / (len(reflected) + len(guided))
    again, _, _ = stages.generate_step(rt, 1)
    assert again == kept  # the same seeds give the same corrected batch


def test_reflections_sample_like_their_round_under_the_adaptive_temperature(monkeypatch):
    """GEC composes with HAPO's adaptive temperature: the continuation is sampled with the round's
    temperature rule and entropy statistics (only n, the budget and the seed differ)."""
    from hapo_megatron.algo import EntropyStats

    monkeypatch.setattr(stages, "broadcast_object", lambda obj: obj)
    engine = _Engine()
    rt = _runtime(engine, ["algo.adaptive_temperature=true", "algo.temperature_tau=0.3", "rollout.temperature=0.9",
                           "rollout.top_p=0.95", "algo.edge_gec_reflect_prob=1.0"])
    rt.rl.rollout_entropy_stats = EntropyStats(pivot=-1.0, std=0.5, pos_max=2.0, neg_min=-2.0)
    stages.generate_step(rt, 1)
    (_, first), (_, cont) = engine.calls
    assert cont.uses_adaptive and cont.entropy_stats == first.entropy_stats == rt.rl.rollout_entropy_stats
    assert (cont.temperature, cont.top_p, cont.temperature_tau) == (first.temperature, first.top_p, 0.3)
    assert (first.temperature, first.top_p) == (0.9, 0.95)
