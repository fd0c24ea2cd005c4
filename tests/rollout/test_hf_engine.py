"""HFRolloutEngine against an independent full-forward recomputation on a tiny random Llama."""

import math

import pytest
import torch
import transformers

from hapo_megatron.algo import EntropyStats, adaptive_temperature, compute_entropy_stats, token_entropy
from hapo_megatron.rollout.engine import Sample, SamplingParams
from hapo_megatron.rollout.factory import make_engine
from hapo_megatron.rollout.hf_engine import HFRolloutEngine, apply_top_k, apply_top_p

VOCAB = 64
EOS = 2
PROMPTS = [[1, 5, 7, 9], [3, 4], [10, 11, 12, 13, 14, 15], [6]]


def tiny_config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=64, eos_token_id=EOS, tie_word_embeddings=True)
    base.update(kw)
    return transformers.LlamaConfig(**base)


def make(seed=0, **kw):
    torch.manual_seed(seed)
    return HFRolloutEngine(tiny_config(), dtype=torch.float64, **kw)


@pytest.fixture(scope="module")
def engine():
    return make(max_batch_size=5)


@pytest.fixture(scope="module")
def stats(engine):
    """Entropy statistics of the model itself (varied h_hat in [-1, 1] for its own tokens)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (8, 12), generator=g)
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits
    ent = token_entropy(logits, temperature=1.0)
    return compute_entropy_stats(ent, torch.ones_like(ent, dtype=torch.bool), 0.8)


def full_forward_logits(model, prompt, response):
    """``[len(response), V]`` logits predicting each response token, from one unpadded forward."""
    ids = torch.tensor([list(prompt) + list(response[:-1])])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    return logits[len(prompt) - 1:]


def loop_logprob(z_row, temperature, top_k, top_p, token):
    """Slow, independent top-k / top-p sampling distribution; log-prob of ``token``."""
    scaled = [float(v) / temperature for v in z_row]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    if top_k > 0:
        order = order[:top_k]
    m = max(scaled[i] for i in order)
    w = {i: math.exp(scaled[i] - m) for i in order}
    total = sum(w.values())
    kept, mass = [], 0.0
    for i in order:
        if mass > top_p:
            break
        kept.append(i)
        mass += w[i] / total
    if token not in kept:
        return -math.inf
    z = sum(w[i] for i in kept)
    return math.log(w[token] / z)


@pytest.mark.parametrize("h_hat_mode", ["signed", "reference"])
def test_logprobs_and_temperatures_match_full_forward(engine, stats, h_hat_mode):
    params = SamplingParams(n=3, temperature=0.9, top_p=0.85, top_k=20, max_new_tokens=8, seed=11,
                            adaptive=True, entropy_stats=stats, temperature_tau=0.5, h_hat_mode=h_hat_mode)
    out = engine.generate(PROMPTS, params)
    temps_seen = []
    for group in out:
        for s in group:
            logits = full_forward_logits(engine.model, s.prompt_ids, s.response_ids)
            want_t = adaptive_temperature(logits, stats, 0.9, 0.5, h_hat_mode)
            assert torch.allclose(torch.tensor(s.temperatures, dtype=torch.float32), want_t, atol=1e-5)
            for j, tok in enumerate(s.response_ids):
                want = loop_logprob(logits[j].tolist(), float(want_t[j]), 20, 0.85, tok)
                assert math.isfinite(want)
                assert s.rollout_logprobs[j] == pytest.approx(want, abs=1e-5)
            temps_seen += s.temperatures.tolist()
    # the adaptive temperature really varies and stays within T_base * (1 +- tau)
    assert max(temps_seen) - min(temps_seen) > 0.05
    assert all(0.9 * 0.5 - 1e-6 <= t <= 0.9 * 1.5 + 1e-6 for t in temps_seen)


def test_not_adaptive_uses_base_temperature(engine, stats):
    for params in (SamplingParams(n=2, temperature=0.7, top_p=1.0, top_k=-1, max_new_tokens=5, seed=1, adaptive=False,
                                  entropy_stats=stats),
                   SamplingParams(n=2, temperature=0.7, top_p=1.0, top_k=-1, max_new_tokens=5, seed=1, adaptive=True,
                                  entropy_stats=None, temperature_tau=0.05, h_hat_mode="signed")):
        for group in engine.generate(PROMPTS[:2], params):
            for s in group:
                assert s.temperatures == pytest.approx([0.7] * len(s.response_ids))
                logits = full_forward_logits(engine.model, s.prompt_ids, s.response_ids)
                ids = torch.tensor(s.response_ids, dtype=torch.long)
                want = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, ids[:, None])
                assert torch.allclose(torch.tensor(s.rollout_logprobs), want.squeeze(-1), atol=1e-5)


def test_determinism_with_seed(engine, stats):
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=10, seed=123, adaptive=True,
                            entropy_stats=stats, temperature_tau=0.3, h_hat_mode="signed")
    a = engine.generate(PROMPTS, params)
    b = engine.generate(PROMPTS, params)
    c = engine.generate(PROMPTS, params.with_(seed=124))
    flat = lambda out: [(s.response_ids.tolist(), s.rollout_logprobs.tolist(), s.temperatures.tolist())
                        for g in out for s in g]
    assert flat(a) == flat(b)
    assert [x[0] for x in flat(a)] != [x[0] for x in flat(c)]


def test_n_samples_ordering(engine):
    params = SamplingParams(n=3, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=4, seed=5)
    out = engine.generate(PROMPTS, params)
    assert len(out) == len(PROMPTS)
    for p, group in enumerate(out):
        assert [s.sample_index for s in group] == [0, 1, 2]
        assert all(isinstance(s, Sample) and s.prompt_index == p and s.prompt_ids.tolist() == PROMPTS[p] for s in group)


def test_greedy_matches_argmax_and_padding_invariance(engine):
    params = SamplingParams(n=2, temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=6, ignore_eos=True)
    batched = engine.generate(PROMPTS, params)
    for p, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], params)[0][0]
        assert batched[p][0].response_ids.tolist() == alone.response_ids.tolist() == batched[p][1].response_ids.tolist()
        s = batched[p][0]
        logits = full_forward_logits(engine.model, prompt, s.response_ids)
        assert s.response_ids.tolist() == logits.argmax(-1).tolist()
        assert s.temperatures.tolist() == [0.0] * 6 and s.finish_reason == "length"
        ids = torch.tensor(s.response_ids, dtype=torch.long)
        want = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(s.rollout_logprobs), want, atol=1e-5)


def test_stop_tokens_and_max_new_tokens(engine):
    # eos (2) and an extra stop token; long enough that most rows stop
    params = SamplingParams(n=8, temperature=1.5, top_p=1.0, top_k=-1, max_new_tokens=40, seed=2,
                            stop_token_ids=(7, 8, 9))
    stops = {EOS, 7, 8, 9}
    reasons = set()
    for group in engine.generate(PROMPTS, params):
        for s in group:
            reasons.add(s.finish_reason)
            body = s.response_ids[:-1]
            assert not (set(body) & stops)
            if s.finish_reason == "stop":
                assert s.response_ids[-1] in stops
            else:
                assert len(s.response_ids) == 40 and s.response_ids[-1] not in stops
    assert "stop" in reasons
    short = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=3, seed=2, ignore_eos=True)
    for group in engine.generate(PROMPTS, short):
        for s in group:
            assert len(s.response_ids) == 3 and s.finish_reason == "length"


def test_ignore_eos_keeps_generating_past_eos():
    eng = make(max_batch_size=64)
    params = SamplingParams(n=16, temperature=2.0, top_p=1.0, top_k=-1, max_new_tokens=30, seed=0, ignore_eos=True)
    ids = [t for g in eng.generate(PROMPTS, params) for s in g for t in s.response_ids[:-1]]
    assert EOS in ids  # eos appears mid-response: it did not stop


def test_chunking_gives_same_greedy_results(engine):
    params = SamplingParams(n=3, temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=5)
    small = make(max_batch_size=2)
    small.model.load_state_dict(engine.model.state_dict())
    a = [s.response_ids.tolist() for g in engine.generate(PROMPTS, params) for s in g]
    b = [s.response_ids.tolist() for g in small.generate(PROMPTS, params) for s in g]
    assert a == b


def test_update_weights_changes_outputs_and_is_checked():
    eng = make(seed=0)
    other = make(seed=1)
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=8, ignore_eos=True, seed=4)
    before = eng.generate(PROMPTS, params)
    target = other.generate(PROMPTS, params)
    sd = {k: v.clone() for k, v in other.model.state_dict().items()}
    # tied embeddings: giving only one alias is enough
    named = [(k, v.float()) for k, v in sd.items() if k != "lm_head.weight"]
    eng.update_weights(iter(named))
    after = eng.generate(PROMPTS, params)
    ids = lambda out: [(s.response_ids.tolist(), [round(x, 6) for x in s.rollout_logprobs.tolist()])
                       for g in out for s in g]
    assert ids(after) == ids(target) != ids(before)
    snapshot = {k: v.clone() for k, v in eng.model.state_dict().items()}
    with pytest.raises(ValueError, match="unknown names.*model.bogus.weight"):
        eng.update_weights(named + [("model.bogus.weight", torch.zeros(2))])
    with pytest.raises(ValueError, match="shape mismatches.*model.norm.weight"):
        eng.update_weights([(k, v if k != "model.norm.weight" else torch.zeros(3)) for k, v in named])
    with pytest.raises(ValueError, match="missing model tensors.*model.norm.weight"):
        eng.update_weights([(k, v * 0) for k, v in named if k != "model.norm.weight"])
    with pytest.raises(ValueError, match="duplicates"):
        eng.update_weights(named + named[:1])
    assert all(torch.equal(snapshot[k], v) for k, v in eng.model.state_dict().items())  # unchanged


def test_nan_logits_raise_clear_error():
    eng = make()
    with torch.no_grad():
        eng.model.model.norm.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="NaN"):
        eng.generate([[1, 2, 3]], SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=3, seed=0))


def test_bad_inputs():
    eng = make()
    with pytest.raises(ValueError, match="prompt_ids\\[1\\]"):
        eng.generate([[1], []], SamplingParams(temperature=1.0, top_p=1.0, top_k=-1))
    with pytest.raises(ValueError, match="vocab_size"):
        eng.generate([[VOCAB + 3]], SamplingParams(temperature=1.0, top_p=1.0, top_k=-1))
    with pytest.raises(ValueError, match="params"):
        eng.generate([[1]], {"n": 1})
    plain = dict(temperature=1.0, top_p=1.0, top_k=-1)
    for bad in (dict(n=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=0), dict(max_new_tokens=0),
                dict(temperature_tau=1.0), dict(h_hat_mode="x")):
        with pytest.raises(ValueError):
            SamplingParams(**{**plain, **bad})


def test_top_k_top_p_filters_match_loop():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 30, generator=g, dtype=torch.float64) * 2
    for k, p in ((5, 1.0), (-1, 0.6), (7, 0.5), (30, 0.95)):
        lp = torch.log_softmax(apply_top_p(apply_top_k(z, k), p), -1)
        for r in range(z.shape[0]):
            for v in range(z.shape[1]):
                want = loop_logprob(z[r].tolist(), 1.0, k if k < 30 else -1, p, v)
                got = float(lp[r, v])
                assert (got == want == -math.inf) or got == pytest.approx(want, abs=1e-9)


def test_make_engine_and_from_config():
    from hapo_megatron.config import AlgoConfig, RolloutConfig

    rc = RolloutConfig(engine="hf", n=4, temperature=1.0, max_response_length=16, hf_max_batch_size=3)
    eng = make_engine(rc, hf_config_or_path=tiny_config(), device="cpu", dtype=torch.float32)
    assert isinstance(eng, HFRolloutEngine) and eng.max_batch_size == 3
    st = EntropyStats(pivot=1.0, std=0.5, pos_max=2.0, neg_min=-2.0)
    train = SamplingParams.from_config(rc, AlgoConfig(), entropy_stats=st, seed=3)
    assert (train.n, train.max_new_tokens, train.uses_adaptive, train.entropy_stats) == (4, 16, True, st)
    val = SamplingParams.from_config(rc, AlgoConfig(), validation=True, entropy_stats=st)
    assert (val.n, val.temperature, val.top_p, val.uses_adaptive) == (rc.val_n, rc.val_temperature, rc.val_top_p, False)
    off = SamplingParams.from_config(rc, AlgoConfig(adaptive_temperature=False), entropy_stats=st)
    assert not off.uses_adaptive and off.entropy_stats is None
    out = eng.generate([[1, 2]], train)
    assert len(out[0]) == 4 and all(len(s.response_ids) <= 16 for s in out[0])
    with pytest.raises(ValueError, match="engine"):
        make_engine(type("C", (), {"engine": "vllm"})(), hf_config_or_path=tiny_config())


def test_on_samples_gets_each_batch_as_it_finishes(engine):
    small = make(max_batch_size=5)
    small.model.load_state_dict(engine.model.state_dict())
    chunks = []
    out = small.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=3, seed=1),
                         on_samples=chunks.append)
    assert [len(c) for c in chunks] == [5, 5, 2]  # 12 rows in batches of max_batch_size
    assert [(s.prompt_index, s.sample_index) for c in chunks for s in c] == \
        [(p, k) for p in range(len(PROMPTS)) for k in range(3)]
    assert [s for c in chunks for s in c] == [s for g in out for s in g]


def test_generation_logs_no_deprecation_of_transformers():
    """The KV cache goes by the name the installed transformers takes (docs/troubleshooting.md,
    "Warnings"): no deprecation notice in the run's log."""
    import logging

    logging.Logger.warning_once.cache_clear()  # a notice logged earlier in this process would hide one now
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        make().generate([[3, 4, 5]], SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=4,
                                                    seed=1))
    finally:
        logger.removeHandler(handler)
    assert not [r.getMessage() for r in records if "deprecated" in r.getMessage()]
