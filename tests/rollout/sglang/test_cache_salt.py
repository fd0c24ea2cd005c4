"""``pause_mode: in_place`` and SGLang's radix cache (docs/architecture.md, "Asynchronous rollouts").

An in-place update cannot flush the servers' cache (SGLang 0.5.23 flushes only an idle server),
so without more, a request sent after the update reuses the prompt-prefix KV that the old weights
computed, and its tokens still report the new weight version. The engine sends every /generate
from the start of such an update on with a ``cache_salt`` of that version: SGLang's radix cache
matches a prefix only within one salt.

The stand-in server models that cache: per salt, the prefixes it computed and under which weight
version; a request reports how many prompt tokens it reused and whether any came from older
weights. Mutations tried: no salt (`ServerSupervisor.request` sends the body as it is), and the
salt set after the sync instead of before it: in both a request after the update reuses
old-weight KV.
"""

from __future__ import annotations

import pytest
import torch

from hapo_megatron.rollout.engine import SamplingParams
from hapo_megatron.rollout.sglang import engine as se
from tests.rollout.sglang.engines import sglang_engine

from .fake_sglang import FakeResponse, FakeSession

PROMPT = [5, 6, 7, 8, 9]
PARAMS = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=2)


class RadixStandIn(FakeSession):
    """A FakeSession whose /generate answers with ``meta_info.cached_tokens`` (as SGLang does) and
    ``stale_tokens`` (reused tokens computed under another weight version than the current one),
    from a model of the radix cache keyed by ``cache_salt``. The weights change with
    ``/update_weights_from_disk`` (its ``weight_version``). ``hold_update`` sends requests while
    an update is in progress; paused, the server runs them after it, on the new weights."""

    def __init__(self):
        super().__init__()
        self.version = "0"
        self.cache: dict = {}  # (salt, prefix tuple) -> the version that computed its KV
        self.answers = []
        self.hold_update = None  # callable run during an update (requests sent meanwhile)

    def post(self, url, json=None, timeout=None, headers=None):
        path = "/" + url.split("/", 3)[-1]
        if path == "/update_weights_from_disk":
            self.calls.append(("POST", url, json))
            self.version = json.get("weight_version") or self.version
            if self.hold_update is not None:  # sent during the pause: it runs once generation continues
                self.hold_update()
            return FakeResponse(200, {"success": True, "message": ""})
        if path != "/generate":
            return super().post(url, json=json, timeout=timeout, headers=headers)
        self.calls.append(("POST", url, json))
        salt = json.get("cache_salt")
        out = []
        for ids in json["input_ids"]:
            ids = tuple(ids)
            cached = max((n for n in range(1, len(ids)) if (salt, ids[:n]) in self.cache), default=0)
            stale = sum(1 for n in range(1, cached + 1) if self.cache[(salt, ids[:n])] != self.version)
            for n in range(1, len(ids) + 1):
                self.cache.setdefault((salt, ids[:n]), self.version)  # an existing node keeps its KV
            toks = [ids[0] + 1, ids[0] + 2]
            out.append({"output_ids": toks, "meta_info": {
                "finish_reason": {"type": "length"}, "cached_tokens": cached, "stale_tokens": stale,
                "output_token_logprobs": [[-0.1, t, None] for t in toks]}})
        self.answers.append(out)
        return FakeResponse(200, out)


def _generate(eng):
    (item,) = eng.supervisor.request(0, "/generate", se.generate_payload([PROMPT], PARAMS))
    return item["meta_info"]


def _engine(sess, tmp_path):
    return sglang_engine(server_urls=["http://127.0.0.1:30000"], weight_sync="disk", colocate=False, session=sess,
                         launch=False, disk_sync_dir=str(tmp_path / "w"), device="cuda", wait_for_servers=False)


def test_requests_after_an_in_place_update_reuse_no_old_weight_kv(tmp_path):
    sess = RadixStandIn()
    eng = _engine(sess, tmp_path)
    assert _generate(eng)["cached_tokens"] == 0
    assert _generate(eng)["cached_tokens"] == len(PROMPT) - 1  # the stand-in's cache works

    during = []
    sess.hold_update = lambda: during.append(_generate(eng))  # queued during the pause, runs on the new weights
    eng.pause_generation("in_place")
    eng.update_weights(iter([("lm_head.weight", torch.ones(2, 4))]), weight_version=1, flush_cache=False)
    eng.continue_generation()
    after = _generate(eng)
    assert during[0]["stale_tokens"] == 0 and after["stale_tokens"] == 0, (during, after)
    assert after["cached_tokens"] == len(PROMPT) - 1  # prefixes computed under version 1 are reused

    sess.hold_update = None
    eng.update_weights(iter([("lm_head.weight", torch.ones(2, 4))]), weight_version=2, flush_cache=False)
    again = _generate(eng)
    assert again["stale_tokens"] == 0 and again["cached_tokens"] == 0
    salts = [b.get("cache_salt") for _, b in sess.posts("/generate")]
    assert salts == [None, None, "hapo-weights-1", "hapo-weights-1", "hapo-weights-2"]


def test_a_flushing_update_keeps_the_namespace(tmp_path):
    """A retract / abort update flushes the cache itself: no salt is needed (and none is sent)."""
    sess = RadixStandIn()
    eng = _engine(sess, tmp_path)
    eng.update_weights(iter([("lm_head.weight", torch.ones(2, 4))]), weight_version=1, flush_cache=True)
    _generate(eng)
    assert [b.get("cache_salt") for _, b in sess.posts("/generate")] == [None]
    assert [b["flush_cache"] for _, b in sess.posts("/update_weights_from_disk")] == [True]


@pytest.mark.slow
def test_real_server_reuses_no_prefix_of_the_old_weights(real_server, real_api_key, real_model_dir):
    """The session's REAL CPU SGLang server (tests/rollout/sglang/conftest.py): a prompt's second
    request reuses its cached prefix (``meta_info.cached_tokens`` > 0); after an in-place update
    (pause in place, update without flush, continue) the next one reuses nothing, and the one after
    it reuses the prefix computed under the new weights. Mutation tried: no salt (the request after
    the update reports the old prefix as cached)."""
    from .real_sglang import hf_model

    model = hf_model(None, real_model_dir)
    eng = sglang_engine(server_urls=[real_server.url], launch=False, colocate=True, max_retries=0,
                        request_timeout_s=300, api_key=real_api_key, weight_sync="tensor")
    eng.update_weights(iter(model.state_dict().items()))  # known weights and an empty cache, whatever ran before
    prompt = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48]

    def cached():
        (item,) = eng.supervisor.request(0, "/generate", se.generate_payload([prompt], PARAMS.with_(ignore_eos=True)))
        return item["meta_info"]["cached_tokens"]

    assert cached() == 0
    assert cached() > 0  # the radix cache is on
    eng.pause_generation("in_place")
    eng.update_weights(iter(model.state_dict().items()), weight_version=7, flush_cache=False)
    eng.continue_generation()
    assert cached() == 0
    assert cached() > 0
