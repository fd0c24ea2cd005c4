"""The parse of SGLang's ``/generate`` answers (the rollout manager's largest host cost at recipe
scale, tools/bench/README.md "host_step.py"): the client's JSON decode (orjson with the cyclic
garbage collector paused, the stdlib where orjson refuses) and `generate_item_arrays` /
`answer_samples` give exactly what the old paths gave (the stdlib's ``json.loads`` through requests;
the old per-token Python loop, kept here as the slow reference) on hand-built answers.

Mutations tried: `gc_paused` without its young-generation pass while blocks overlap (fails
`test_overlapping_blocks_still_collect_young_cycles_now_and_then`); `SGLangHTTP._json` without `gc_paused` (fails
`test_the_decode_runs_with_the_collector_paused`), without the orjson path (fails
`test_bytes_go_through_orjson_not_requests`), without the stdlib fallback (fails
`test_what_orjson_refuses_the_stdlib_reads`); `gc_paused` turning the collector on at the first
exit of two (fails `test_gc_paused_counts_nested_and_concurrent_blocks`);
`generate_item_arrays` reading the log-prob as the id (fails the comparison with the reference);
`routed_experts._b64decode` without ``validate=True``, with pybase64 or the stdlib (fails
`test_routes_decode_equals_the_stdlib_decode` of that path)."""

from __future__ import annotations

import gc
import json
import threading

import numpy as np
import pytest
import requests

from hapo_megatron.rollout.engine import Sample
from hapo_megatron.rollout.sglang import client
from hapo_megatron.rollout.sglang.client import SGLangError, SGLangHTTP, gc_paused
from hapo_megatron.rollout.sglang.requests import (answer_samples, generate_item_arrays, parse_generate_item,
                                                   parse_routed_experts, parse_weight_versions)


def _response(raw: bytes) -> requests.Response:
    """A `requests.Response` as requests' adapter builds it for a JSON answer."""
    resp = requests.models.Response()
    resp.status_code, resp._content = 200, raw
    resp.headers["Content-Type"] = "application/json"
    resp.encoding = requests.utils.get_encoding_from_headers(resp.headers)
    return resp


def _old_parse(item: dict) -> tuple[list[int], list[float], str]:
    """The per-token Python loop `generate_item_arrays` replaced (the reference)."""
    meta = item["meta_info"]
    fr = meta.get("finish_reason") or {}
    kind = fr.get("type") if isinstance(fr, dict) else str(fr)
    if kind not in ("stop", "length"):
        raise SGLangError(f"SGLang request finished with {fr!r} (abort / error)")
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise SGLangError("SGLang answer has no output_token_logprobs (return_logprob ignored?)")
    ids = [int(t[1]) for t in triples]
    logps = [float(t[0]) for t in triples]
    out_ids = item.get("output_ids")
    if out_ids is not None and list(map(int, out_ids)) != ids:
        raise SGLangError("output_ids disagree with output_token_logprobs")
    return ids, logps, kind


def _answer(seed: int, rows: int = 3, *, extremes: bool = True) -> list[dict]:
    """Rows of a ``/generate`` answer: float32 log-probs as SGLang sends them, float64 extremes
    (``extremes``: -0.0, the smallest subnormal, the largest double), a text with escapes and
    non-ASCII characters, version spans as strings (SGLang's)."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(rows):
        n = int(rng.integers(1, 50))
        ids = rng.integers(0, 152_000, n).tolist()
        lps = (-rng.exponential(2.0, n)).astype(np.float32).tolist()
        if extremes and r == 0 and n >= 4:
            lps[:4] = [-0.0, -5e-324, -1.7976931348623157e308, -1e-300]
        out.append({"text": 'a "quote" \\ back\nslash é 数学 \U0001f600', "output_ids": ids,
                    "meta_info": {"id": "abc", "finish_reason": {"type": "stop" if r else "length", "matched": ids[-1]},
                                  "prompt_tokens": 7, "weight_version": "2", "input_token_logprobs": [],
                                  "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
                                  "completion_tokens": n,
                                  "weight_versions": [{"version": "1", "start": 0, "end": n // 2},
                                                      {"version": "2", "start": n // 2, "end": n}],
                                  "e2e_latency": 0.123}})
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_decode_gives_what_the_stdlib_gave(seed):
    raw = json.dumps(_answer(seed)).encode()
    got, old = SGLangHTTP._json(_response(raw)), SGLangHTTP._json_stdlib(_response(raw))
    assert got == old == json.loads(raw)
    assert repr(got) == repr(old)  # the same types (int stays int, -0.0 stays -0.0)


def test_empty_bodies_are_none():
    assert SGLangHTTP._json(_response(b"")) is None
    assert SGLangHTTP._json(_response(b" \n")) is None


def test_bytes_go_through_orjson_not_requests():
    pytest.importorskip("orjson")

    class NoStdlib(requests.models.Response):
        def json(self, **kw):
            raise AssertionError("requests' stdlib decode was used")

    resp = _response(b'[{"a": [1.5, 2, null]}]')
    resp.__class__ = NoStdlib
    assert SGLangHTTP._json(resp) == [{"a": [1.5, 2, None]}]


@pytest.mark.parametrize("raw", [b'{"x": NaN, "y": [-Infinity]}', b'[Infinity, 1, "a"]'])
def test_what_orjson_refuses_the_stdlib_reads(raw):
    got = SGLangHTTP._json(_response(raw))
    assert repr(got) == repr(json.loads(raw))


def test_a_transport_without_bytes_still_decodes():
    class Fake:  # the tests' fake sessions hand text and json() only
        text = '{"ok": 1}'

        def json(self):
            return json.loads(self.text)

    assert SGLangHTTP._json(Fake()) == {"ok": 1}


def test_the_decode_runs_with_the_collector_paused(monkeypatch):
    seen = []

    class Spy:
        JSONDecodeError = ValueError

        @staticmethod
        def loads(content):
            seen.append(gc.isenabled())
            return json.loads(content)

    monkeypatch.setattr(client, "_orjson", Spy)
    assert gc.isenabled()
    assert SGLangHTTP._json(_response(b"[1]")) == [1]
    assert seen == [False] and gc.isenabled()
    monkeypatch.setattr(client, "_orjson", None)  # the stdlib path is paused too

    class Fake:
        text = "[2]"

        def json(self):
            seen.append(gc.isenabled())
            return [2]

    assert SGLangHTTP._json(Fake()) == [2]
    assert seen == [False, False] and gc.isenabled()


def test_gc_paused_counts_nested_and_concurrent_blocks():
    assert gc.isenabled()
    inside, release = threading.Event(), threading.Event()

    def other():
        with gc_paused():
            inside.set()
            release.wait()

    t = threading.Thread(target=other, daemon=True)
    states = []
    try:
        with gc_paused():
            t.start()
            inside.wait()
            with gc_paused():
                states.append(gc.isenabled())
            states.append(gc.isenabled())
        states.append(gc.isenabled())  # the other thread is still inside
    finally:
        release.set()
        t.join()
    assert states == [False, False, False]
    assert gc.isenabled()
    gc.disable()
    try:  # off before: stays off
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_overlapping_blocks_still_collect_young_cycles_now_and_then(monkeypatch):
    """Blocks that overlap back to back never leave the collector on: one leaving while another is
    inside runs a young-generation pass once ``GC_YOUNG_PASS_EVERY_S`` has gone by (0 here)."""
    from hapo_megatron.rollout.sglang import client
    passes = []
    monkeypatch.setattr(client.gc, "collect", lambda generation=2: passes.append(generation))
    monkeypatch.setattr(client, "GC_YOUNG_PASS_EVERY_S", 0.0)
    with gc_paused():
        with gc_paused():
            pass  # leaves while the outer block is inside
        assert passes == [0] and not gc.isenabled()
    assert passes == [0] and gc.isenabled()  # the last one out turns it back on instead
    monkeypatch.setattr(client, "GC_YOUNG_PASS_EVERY_S", 3600.0)
    with gc_paused():
        with gc_paused():
            pass
    assert passes == [0]  # not due yet


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_arrays_equal_the_per_token_reference(seed):
    for item in _answer(seed, rows=5):
        ids, lps, kind = generate_item_arrays(item)
        ref_ids, ref_lps, ref_kind = _old_parse(item)
        assert ids.dtype == np.int64 and lps.dtype == np.float64 and kind == ref_kind
        assert ids.tolist() == ref_ids
        assert lps.tobytes() == np.array(ref_lps, np.float64).tobytes()  # bit for bit (-0.0, subnormals)
        assert parse_generate_item(item) == (ref_ids, ref_lps, ref_kind)


def test_arrays_refuse_what_the_reference_refuses():
    item = _answer(0, rows=1)[0]
    for bad, match in ((dict(item, output_ids=item["output_ids"][:-1]), "disagree"),
                       ({"meta_info": {**item["meta_info"], "finish_reason": {"type": "abort"}}}, "abort"),
                       ({"meta_info": {"finish_reason": {"type": "stop"}}}, "output_token_logprobs")):
        with pytest.raises(SGLangError, match=match):
            generate_item_arrays(bad)
        with pytest.raises(SGLangError, match=match):
            _old_parse(bad)
    broken = {"meta_info": {**item["meta_info"], "output_token_logprobs": [[-0.5, None, None]]}}
    with pytest.raises(TypeError):
        generate_item_arrays(broken)


def test_answer_samples_equal_samples_of_the_reference():
    answer = _answer(5, rows=4, extremes=False)  # a Sample holds float32
    prompts = [[9, 8, 7], [1, 2]]
    rows = [(1, 0), (0, 3), (1, 1), (0, 0)]
    got = answer_samples(answer, prompts, rows, return_routes=False)
    for s, item, (p, k) in zip(got, answer, rows):
        ids, lps, kind = _old_parse(item)
        ref = Sample(prompt_ids=prompts[p], response_ids=ids, rollout_logprobs=lps, temperatures=[],
                     finish_reason=kind, prompt_index=p, sample_index=k,
                     weight_versions=parse_weight_versions(item, len(ids)))
        for name in ("prompt_ids", "response_ids", "rollout_logprobs", "weight_versions"):
            assert getattr(s, name).dtype == getattr(ref, name).dtype
            assert getattr(s, name).tobytes() == getattr(ref, name).tobytes(), name
        assert (s.finish_reason, s.prompt_index, s.sample_index) == (kind, p, k)
        n = len(ids)
        assert s.weight_versions.tolist() == [1] * (n // 2) + [2] * (n - n // 2)
    with pytest.raises(SGLangError, match="for 3 rows"):
        answer_samples(answer, prompts, rows[:3], return_routes=False)


def test_answer_samples_decode_the_routes():
    import base64
    item = _answer(6, rows=1, extremes=False)[0]
    n = len(item["output_ids"])
    routes = np.random.default_rng(0).integers(0, 128, (3 + n - 1, 4 * 2), dtype=np.int32)
    item["meta_info"]["routed_experts"] = base64.b64encode(routes.tobytes()).decode()
    (s,) = answer_samples([item], [[1, 2, 3]], [(0, 0)], return_routes=True)
    assert s.routed_experts.dtype == np.int16 and np.array_equal(s.routed_experts, routes)
    assert np.array_equal(s.routed_experts, parse_routed_experts(item, 3 + n - 1))


@pytest.mark.parametrize("fast", [True, False])
def test_routes_decode_equals_the_stdlib_decode(monkeypatch, fast):
    import base64

    from hapo_megatron.rollout import routed_experts
    if fast:
        pytest.importorskip("pybase64")
    else:
        monkeypatch.setattr(routed_experts, "_pybase64", None)
    rng = np.random.default_rng(1)
    for positions in (1, 7, 300):
        routes = rng.integers(0, 32_000, (positions, 6), dtype=np.int32)
        encoded = base64.b64encode(routes.tobytes()).decode()
        ref = np.frombuffer(base64.b64decode(encoded), np.int32).reshape(positions, -1).astype(np.int16)
        got = routed_experts.decode_routed_experts(encoded, positions)
        assert got.dtype == np.int16 and np.array_equal(got, ref)
    with pytest.raises(ValueError):  # strict: a character outside the alphabet is an error, not skipped
        routed_experts.decode_routed_experts(encoded[:8] + "!" + encoded[8:], 300)
