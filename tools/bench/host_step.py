"""The host (CPU) side of one rollout step at recipe scale.

A synthetic rollout of ``--prompts x --n`` responses (prompts of ``--prompt-len`` tokens, lognormal
response lengths of mean ``--mean`` and shape ``--sigma``, capped at ``--cap``; each response ends in
a ``\\boxed{}`` answer, right or wrong) goes through the real math reward and the real data path,
each role in a fresh process (its peak RSS is its own):

- **rank 0** (`stages.generate_step` with a stand-in engine that hands over chunks of ``--chunk``
  responses evenly over ``--gen-s`` seconds, as SGLang's ``/generate`` calls return; the reward
  workers, ``reward.num_workers`` auto, score while it "generates"), then the kept batch split per
  DP rank and pickled (`stages._share_out`'s work). Reported: the seconds from the last response
  to the messages being ready.
- **one rank, per ``--dp``**: receive (unpickle the message bytes: the network transfer itself is
  not simulated; the message size is printed) + advantages + layout of DP rank 0's micro-batches;
  seconds and RSS growth over the process before the message arrived.

With ``--manager``, the rollout manager process's host work for one step instead
(training/asynchronous/; docs/architecture.md, "The manager at recipe scale"): each prompt
group's ``/generate`` answer as SGLang 0.5.23 writes it (the bytes built untimed, one group at a
time), decoded by the real HTTP client and parsed by
`requests.answer_samples` (checked against what was encoded), then the producer's own group path
(`AsyncRollout._group`: the math reward in ``reward.num_workers`` workers, build, shape, filter),
the step's take, and the transport (`transport.py`) to a rank-0 process, with the time the recipe's
rollout GPUs take to generate the step beside it (``--rollout-gpus`` x
``--decode-tokens-per-s-per-gpu``). Groups run one after another with generation instant: the
sum is the manager's host seconds per step, an upper bound (the producer's threads overlap
parsing with the reward workers). ``--routes`` adds the parse of answers with MoE routes.

    python tools/bench/host_step.py                                   # 512 x 16, mean 2.5k, DP 1 and 8
    python tools/bench/host_step.py --prompts 32 --n 4 --mean 300 --gen-s 2 --dp 1 2   # quick
    python tools/bench/host_step.py --manager --mean 10000 --sigma 0  # 512 x 16 responses of 10k tokens
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import math
import os
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

LAYOUT = dict(ppo_mini_batch_size=32, micro_batch_size=1, max_tokens_per_micro_batch=22528, pack=False)  # 7B recipe
WORDS = np.array([f"w{i} " for i in range(1000)])


# --------------------------------------------------------------------------- the synthetic rollout
def synth(prompts: int, n: int, prompt_len: int, mean: float, sigma: float, cap: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    mu = math.log(mean) - sigma ** 2 / 2  # E[lognormal(mu, sigma)] = exp(mu + sigma^2 / 2)
    lengths = np.minimum(np.maximum(np.round(rng.lognormal(mu, sigma, prompts * n)), 2), cap).astype(np.int64)
    resp = rng.integers(0, 150_000, int(lengths.sum()), dtype=np.int64).astype(np.int32)
    ends = np.cumsum(lengths) - 1
    answers = rng.integers(0, 4, prompts * n)  # the last token encodes the answer: right (0) or wrong
    resp[ends] = answers.astype(np.int32)
    return {"prompts": rng.integers(0, 150_000, (prompts, prompt_len), dtype=np.int64).astype(np.int32),
            "resp": resp, "lengths": lengths, "logprobs": -rng.random(len(resp), dtype=np.float32),
            "n": np.int64(n), "cap": np.int64(cap), "truths": rng.integers(0, 100, prompts)}


def decode(ids) -> str:
    """Stand-in tokenizer: one word per token (the cost grows with the length), the last token the
    answer: ``\\boxed{truth}`` for 0, another number otherwise."""
    ids = np.asarray(ids)
    body = "".join(WORDS[ids[:-1] % 1000])
    return body + f" so the answer is \\boxed{{{int(ids[-1])}}}"


def records(d: dict) -> list:
    return [SimpleNamespace(prompt_ids=p.tolist(), ground_truth="0", data_source="math", extra_info=None)
            for p in d["prompts"]]


def samples(d: dict) -> list[list]:
    """``samples[prompt][k]``: the engine's answer, as arrays."""
    from hapo_megatron.rollout.engine import Sample
    off = np.concatenate([[0], np.cumsum(d["lengths"])])
    n = int(d["n"])
    out = []
    for p, prompt in enumerate(d["prompts"]):
        group = []
        for k in range(n):
            i = p * n + k
            a, b = off[i], off[i + 1]
            group.append(Sample(prompt_ids=prompt, response_ids=d["resp"][a:b],
                                rollout_logprobs=d["logprobs"][a:b], temperatures=[],
                                finish_reason="stop", prompt_index=p, sample_index=k))
        out.append(group)
    return out


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


# --------------------------------------------------------------------------- the roles
def _cfg(prompts: int, n: int, cap: int):
    from hapo_megatron.config import HapoConfig
    return HapoConfig.from_dict({
        "data": {"train_batch_size": prompts},
        "trainer": {"ppo_mini_batch_size": LAYOUT["ppo_mini_batch_size"]},
        "rollout": {"n": n, "max_response_length": cap},
        "algo": {"adaptive_temperature": False, "filter_groups": True, "max_num_gen_batches": 1},
        "parallel": {"micro_batch_size": LAYOUT["micro_batch_size"],
                     "max_tokens_per_micro_batch": LAYOUT["max_tokens_per_micro_batch"],
                     "pack_sequences": LAYOUT["pack"]},
        "reward": {"reward_fn": "math"}})


class _ChunkedEngine:
    """Stand-in for the SGLang engine: hands the samples over in chunks of ``chunk`` evenly over
    ``gen_s`` seconds (generation itself is not simulated), records when the last one arrived."""

    def __init__(self, smp: list, chunk: int, gen_s: float):
        self.smp, self.chunk, self.gen_s, self.last_response = smp, chunk, gen_s, None

    def generate(self, prompt_ids, params, on_samples=None):
        flat = [s for group in self.smp for s in group]
        parts = [flat[i:i + self.chunk] for i in range(0, len(flat), self.chunk)]
        start = time.monotonic()
        for k, part in enumerate(parts):
            time.sleep(max(0.0, start + self.gen_s * (k + 1) / len(parts) - time.monotonic()))
            if on_samples is not None:
                on_samples(part)
        self.last_response = time.perf_counter()
        return self.smp

    # the rest of the RolloutEngine protocol (rollout/engine.py), which the synchronous loop calls
    dtype, send_sampling_seed, stop_check = None, False, None

    def generate_group(self, rows, params):
        raise NotImplementedError("the host-step bench runs the synchronous loop only")

    def update_weights(self, named_tensors, *, weight_version=None, flush_cache=True):
        from hapo_megatron.rollout.engine import drain_weights
        drain_weights(named_tensors)

    def release_memory(self, tags=None):
        pass

    def resume_memory(self, tags=None):
        pass

    def abort_requests(self):
        pass

    def pause_generation(self, mode="retract"):
        pass

    def continue_generation(self):
        pass

    def spread_calls(self, enabled=True):
        pass

    def fault_metrics(self):
        return {}

    def check_health(self):
        pass

    def shutdown(self):
        pass


def role_rank0(d: dict, out_dir: str, cap: int, chunk: int, gen_s: float, dps: list[int]) -> dict:
    from hapo_megatron.rewards import get_reward_fn
    from hapo_megatron.rewards.scoring import RewardScorer
    from hapo_megatron.training import stages
    from hapo_megatron.training.memory.engine_memory import EngineMemory
    from hapo_megatron.training.batches.rollout_batch import DynamicSampler
    from hapo_megatron.training.batches.rollout_share import SequenceMeta, split_for_ranks
    prompts, n = len(d["prompts"]), int(d["n"])
    cfg = _cfg(prompts, n, cap)
    recs = records(d)
    engine = _ChunkedEngine(samples(d), chunk, gen_s)
    scorer = RewardScorer(cfg.reward)
    rt = SimpleNamespace(
        cfg=cfg, engine=engine, memory=EngineMemory(engine), control=SimpleNamespace(send=lambda kind, body: None),
        sampling_seed=lambda step, i: 0,
        actor=SimpleNamespace(routing="off"),  # a dense model: no experts to return
        tokenizer=SimpleNamespace(decode=lambda ids, **_: decode(ids), eos_token_id=None),
        reward_fn=get_reward_fn("math"), scorer=scorer,
        rl=SimpleNamespace(dyn=DynamicSampler(enabled=True, max_num_gen_batches=1, metric='acc'),
                           sampler=SimpleNamespace(next_batch=lambda: recs, state_dict=lambda: {}),
                           rollout_entropy_stats=None))
    try:
        kept, metrics, _ = stages.generate_step(rt, 1)
        t_ready = time.perf_counter()
        meta = SequenceMeta.of(kept)
        out = {}
        for dp in dps:  # what `stages._share_out` does on rank 0: split, one message per DP rank
            t0 = time.perf_counter()
            parts = [kept] if dp == 1 else split_for_ranks(kept, stages._plan(_rt_for(cfg, dp, 0), meta), dp)
            msgs = [pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL) for p in parts]
            split_s = time.perf_counter() - t0
            with open(os.path.join(out_dir, f"dp{dp}.msg"), "wb") as f:
                f.write(msgs[0])
            out[dp] = {"split+pickle_s": split_s, "message_mb_rank0": len(msgs[0]) / 2 ** 20,
                       "messages_mb_total": sum(map(len, msgs)) / 2 ** 20}
        with open(os.path.join(out_dir, "meta.msg"), "wb") as f:
            f.write(pickle.dumps((meta, metrics), protocol=pickle.HIGHEST_PROTOCOL))
    finally:
        scorer.close()
    first = out[dps[0]]
    return {"after_last_response_s": t_ready - engine.last_response + first["split+pickle_s"],
            "results+build+filter+metrics_s": t_ready - engine.last_response, "per_dp": out,
            "reward_wait_s": metrics["timing/reward_wait_s"], "kept": len(kept),
            "num_workers": scorer.pool.num_workers if scorer.pool is not None else 0, "peak_rss_mb": peak_rss_mb()}


def _rt_for(cfg, dp: int, dp_rank: int):
    return SimpleNamespace(cfg=cfg, groups=SimpleNamespace(tp_size=1, cp_size=1, dp_size=dp, dp_rank=dp_rank))


def role_rank(out_dir: str, dp: int, prompts: int, n: int, cap: int) -> dict:
    from hapo_megatron.training import stages
    from hapo_megatron.training.batches.rollout_share import RankBatch, held_sequences
    cfg = _cfg(prompts, n, cap)
    rss0 = rss_mb()
    with open(os.path.join(out_dir, "meta.msg"), "rb") as f:
        raw_meta = f.read()
    with open(os.path.join(out_dir, f"dp{dp}.msg"), "rb") as f:
        raw = f.read()
    t0 = time.perf_counter()
    meta, _ = pickle.loads(raw_meta)
    tokens = pickle.loads(raw)
    t_recv = time.perf_counter() - t0
    rt = _rt_for(cfg, dp, 0)
    plans = stages._plan(rt, meta)
    batch = RankBatch(meta, held_sequences(plans, 0) if dp > 1 else np.arange(len(meta)), tokens, plans)
    adv, _ = stages.advantages(rt, batch)
    mbs, _ = stages.layout(rt, batch, adv)
    total = time.perf_counter() - t0
    tokens_laid = sum(int(mb.loss_mask.sum()) for mini in mbs for mb in mini)
    return {"receive_s": t_recv, "receive+layout_s": total, "rss_growth_mb": peak_rss_mb() - rss0,
            "peak_rss_mb": peak_rss_mb(), "message_mb": len(raw) / 2 ** 20, "response_tokens_laid_out": tokens_laid,
            "kept_response_tokens": int(meta.response_lengths.sum())}


# --------------------------------------------------------------------------- the manager (--manager)
def _dumps(obj) -> bytes:
    """JSON bytes as SGLang's HTTP server writes them (orjson; the stdlib where it is missing: the
    same shortest round-trip floats, which is all the parse sees)."""
    try:
        import orjson
    except ImportError:
        return json.dumps(obj, separators=(",", ":")).encode()
    return orjson.dumps(obj)


def answer_item(ids: np.ndarray, logprobs, prompt_len: int, finish: str, version: int, *,
                routes: np.ndarray = None, text: str = "") -> dict:
    """One row of SGLang 0.5.23's ``/generate`` answer with ``return_logprob`` (the fields and their
    order of ``TokenizerManager._handle_batch_output``: ``convert_logprob_style`` writes the
    ``[logprob, token_id, null]`` triples, ``add_weight_versions_to_meta_info`` the version spans,
    ``routed_experts`` is base64 of int32 ``[positions, layers, top_k]``). ``logprobs=None``: the
    answer without ``return_logprob``."""
    n, ids_l = len(ids), ids.tolist()
    meta = {"id": "0" * 32, "finish_reason": ({"type": "stop", "matched": ids_l[-1]} if finish == "stop"
                                              else {"type": "length", "length": n}),
            "prompt_tokens": prompt_len, "weight_version": str(version), "num_retractions": 0}
    if logprobs is not None:  # float32 values as Python floats, as the scheduler's .tolist() gives them
        meta.update(input_token_logprobs=[],
                    output_token_logprobs=[[lp, t, None] for lp, t in zip(logprobs.tolist(), ids_l)],
                    output_token_logprobs_length=n)
    meta.update(reasoning_tokens=0, completion_tokens=n, cached_tokens=0,
                weight_versions=[{"version": str(version), "start": 0, "end": n}], e2e_latency=1.0)
    if routes is not None:
        meta["routed_experts"] = base64.b64encode(np.ascontiguousarray(routes, np.int32).tobytes()).decode()
    return {"text": text, "output_ids": ids_l, "meta_info": meta}


def group_rows(d: dict, g: int) -> list[tuple[np.ndarray, np.ndarray, str]]:
    """``(response ids, log-probs, finish reason)`` of prompt group ``g``'s rows."""
    off, n, cap = np.concatenate([[0], np.cumsum(d["lengths"])]), int(d["n"]), int(d["cap"])
    return [(d["resp"][off[i]:off[i + 1]], d["logprobs"][off[i]:off[i + 1]],
             "length" if d["lengths"][i] >= cap else "stop") for i in range(g * n, g * n + n)]


def group_answer(d: dict, g: int, version: int, *, logprobs: bool = True, routes_shape=None,
                 rng=None) -> tuple[bytes, list]:
    """The bytes of group ``g``'s ``/generate`` answer (one call per group, as the producer sends),
    and the routes encoded (``routes_shape=(layers, top_k, experts)``; else None per row)."""
    prompt_len = d["prompts"].shape[1]
    items, routes = [], []
    for ids, lps, finish in group_rows(d, g):
        r = (None if routes_shape is None else
             rng.integers(0, routes_shape[2], (prompt_len + len(ids) - 1, routes_shape[0] * routes_shape[1]),
                          dtype=np.int32))
        routes.append(r)
        items.append(answer_item(ids, lps if logprobs else None, prompt_len, finish, version, routes=r,
                                 text=decode(ids)))
    return _dumps(items), routes


def http_response(raw: bytes):
    """A `requests.Response` holding ``raw`` as requests' adapter builds it for SGLang's JSON answer
    (``_content`` is where requests keeps the body it read; the encoding comes from the header)."""
    import requests
    resp = requests.models.Response()
    resp.status_code, resp._content = 200, raw
    resp.headers["Content-Type"] = "application/json"
    resp.encoding = requests.utils.get_encoding_from_headers(resp.headers)
    return resp


def check_samples(smp: list, d: dict, g: int, version: int, routes: list) -> int:
    """The parsed samples of group ``g`` equal what was encoded (ids, float32 log-probs bit for bit,
    finish reason, prompt, weight versions, routes); the tokens checked."""
    checked = 0
    for s, (ids, lps, finish), r in zip(smp, group_rows(d, g), routes):
        ok = (np.array_equal(s.response_ids, ids) and s.rollout_logprobs.tobytes() == lps.tobytes()
              and s.finish_reason == finish and np.array_equal(s.prompt_ids, d["prompts"][g])
              and np.array_equal(s.weight_versions, np.full(len(ids), version))
              and (r is None or np.array_equal(s.routed_experts, r)))
        if not ok:
            raise AssertionError(f"group {g} row {s.sample_index}: the parsed answer differs from the one encoded")
        checked += len(ids)
    return checked


class _AnswerEngine(_ChunkedEngine):
    """Stand-in for the manager's SGLang engine: `generate` of one prompt group (the producer's call)
    encodes the group's ``/generate`` answer bytes (not timed), then times what the real engine does
    with them: the HTTP client's JSON decode (`SGLangHTTP._json` of a `requests.Response`) and
    `requests.answer_samples`; the parsed samples are checked against the encoded ones (not timed).
    ``group``: the group the driver runs next."""

    def __init__(self, d: dict, version: int, *, floor: bool):
        self.d, self.version, self.floor, self.group = d, version, floor, 0
        self.t = dict(encode_s=0.0, json_stdlib_s=0.0, json_s=0.0, samples_s=0.0, parse_row_s=0.0, floor_json_s=0.0,
                      check_s=0.0)
        self.answer_bytes, self.floor_bytes, self.tokens, self.checked = 0, 0, 0, 0

    def generate(self, prompt_ids, params, on_samples=None):
        from hapo_megatron.rollout.sglang.client import SGLangHTTP
        from hapo_megatron.rollout.sglang.requests import answer_samples, parse_row
        t = self.t
        t0 = time.perf_counter()
        raw, routes = group_answer(self.d, self.group, self.version)
        resp = http_response(raw)
        ts = time.perf_counter()
        SGLangHTTP._json_stdlib(resp)  # the client's decode before orjson, timed beside it in the same run
        t1 = time.perf_counter()
        answer = SGLangHTTP._json(resp)
        t2 = time.perf_counter()
        t["json_stdlib_s"] += t1 - ts
        smp = answer_samples(answer, prompt_ids, [(0, k) for k in range(len(answer))],
                             return_routes=params.return_routes)
        t3 = time.perf_counter()
        [parse_row(item) for item in answer]  # pause_mode abort's parse of the same answer
        t4 = time.perf_counter()
        t["encode_s"] += ts - t0
        t["json_s"] += t2 - t1
        t["samples_s"] += t3 - t2
        t["parse_row_s"] += t4 - t3
        self.answer_bytes += len(raw)
        del raw, resp, answer
        if self.floor:  # the same answer without return_logprob: output_ids only (not a project path)
            t5 = time.perf_counter()
            raw, _ = group_answer(self.d, self.group, self.version, logprobs=False)
            resp = http_response(raw)
            t6 = time.perf_counter()
            answer = SGLangHTTP._json(resp)
            [np.asarray(item["output_ids"], np.int32) for item in answer]
            t7 = time.perf_counter()
            t["encode_s"] += t6 - t5
            t["floor_json_s"] += t7 - t6
            self.floor_bytes += len(raw)
            del raw, resp, answer
        t8 = time.perf_counter()
        self.checked += check_samples(smp, self.d, self.group, self.version, routes)
        self.tokens += sum(len(s.response_ids) for s in smp)
        t["check_s"] += time.perf_counter() - t8
        if on_samples is not None:
            on_samples(smp)
        return [smp]


def _manager_cfg(prompts: int, n: int, cap: int):
    """`_cfg` with the asynchronous loop's settings (the producer's configuration)."""
    from hapo_megatron.config import HapoConfig
    cfg = _cfg(prompts, n, cap).to_dict()
    cfg["rollout"].update(engine="sglang", max_staleness=1)
    cfg["rollout"]["sglang"]["colocate"] = False
    return HapoConfig.from_dict(cfg)


def _receive(conn) -> None:
    """Trainer rank 0's side of the transport (a process of its own): receive one batch, answer the
    monotonic time it was complete and the digest of what it received."""
    from hapo_megatron.training.asynchronous.transport import batch_arrays, recv_batch
    conn.send("ready")
    batch = recv_batch(conn)
    done = time.monotonic()
    conn.send((done, _digest(*batch_arrays(batch)), peak_rss_mb()))


def _digest(header: dict, arrays: list) -> str:
    h = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    for a in arrays:
        h.update(a.tobytes())
    return h.hexdigest()


def role_manager(d: dict, floor: bool) -> dict:
    """The rollout manager's host work for one step, group after group through the producer's own
    group path (`AsyncRollout._group`: generate = parse here, score, build, shape, filter), the
    step's take (`AsyncRollout.take_step`) and the transport to a rank-0 process (`transport.py`)."""
    import multiprocessing
    from hapo_megatron.rewards.scoring import RewardScorer
    from hapo_megatron.training.asynchronous.producer import AsyncRollout
    from hapo_megatron.training.asynchronous.transport import batch_arrays, send_batch
    prompts, n, version = len(d["prompts"]), int(d["n"]), 0
    cfg = _manager_cfg(prompts, n, int(d["cap"]))
    engine = _AnswerEngine(d, version, floor=floor)
    recs = records(d) * 2  # a filtered group frees its place: groups past `prompts` reuse the data
    scorer = RewardScorer(cfg.reward)
    decode_s = [0.0]

    def timed_decode(ids, **_):  # the producer decodes each response for the reward in its own thread
        t = time.perf_counter()
        text = decode(ids)
        decode_s[0] += time.perf_counter() - t
        return text

    rt = SimpleNamespace(cfg=cfg, engine=engine, train_ds=recs, scorer=scorer, sampling_seed=lambda step, i: 0,
                         tokenizer=SimpleNamespace(decode=timed_decode, eos_token_id=None),
                         rl=SimpleNamespace(step=version, sampler=SimpleNamespace(state_dict=lambda: {}),
                                            rollout_entropy_stats=None))
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    receiver = ctx.Process(target=_receive, args=(child,), name="host-step-rank0")
    receiver.start()
    child.close()
    ar = AsyncRollout(rt)
    try:
        t0 = time.perf_counter()
        groups = 0
        while ar.buffer.num_kept < prompts:  # admitted in order: the first `prompts` kept groups are the batch
            idx = groups
            ticket = ar.buffer.admit(idx, timeout=0)
            if ticket is None:
                raise RuntimeError("the lag rule refused a group before the batch was complete")
            engine.group = idx % prompts
            ar._busy(+1)  # what the producer's loop counts before it hands the group to its pool
            ar._group(ticket, idx)
            groups += 1
            if groups > 2 * prompts:
                raise RuntimeError("dynamic sampling filtered half the groups: no batch")
        t1 = time.perf_counter()
        kept, metrics, _, _ = ar.take_step(1)
        t2 = time.perf_counter()
        header, arrays = batch_arrays(kept)
        t3 = time.perf_counter()
        sent_digest, nbytes = _digest(header, arrays), sum(a.nbytes for a in arrays) + len(json.dumps(header))
        del header, arrays
        assert conn.recv() == "ready"
        t4 = time.monotonic()
        send_batch(conn, kept)
        t5 = time.monotonic()
        done, got_digest, rank0_rss = conn.recv()
    finally:
        ar.close()
        scorer.close()
        receiver.join(timeout=60)
        if receiver.is_alive():
            receiver.kill()
    t = engine.t
    groups_s = t1 - t0 - t["encode_s"] - t["check_s"] - t["floor_json_s"] - t["json_stdlib_s"]
    parse_s = t["json_s"] + t["samples_s"] + t["parse_row_s"]
    return {"groups": groups, "kept_groups": len(kept) // n, "responses": groups * n, "tokens": engine.tokens,
            "checked_tokens": engine.checked, "answer_gb": engine.answer_bytes / 1e9,
            "floor_gb": engine.floor_bytes / 1e9, **t,
            "parse_s": t["json_s"] + t["samples_s"],
            "reward_wait_s": metrics["timing/reward_wait_s"],
            "decode_s": decode_s[0], "rest_s": groups_s - parse_s - metrics["timing/reward_wait_s"] - decode_s[0],
            "take_s": t2 - t1, "pack_s": t3 - t2, "send_s": t5 - t4, "send_to_received_s": done - t4,
            "transport_gb": nbytes / 1e9, "received_equal": got_digest == sent_digest,
            "kept_tokens": int(kept.response_ids.flat.size),
            "num_workers": scorer.pool.num_workers if scorer.pool else 0,
            "peak_rss_mb": peak_rss_mb(), "rank0_peak_rss_mb": rank0_rss}


def role_routes(d: dict, shape: tuple, groups: int) -> dict:
    """The parse of ``groups`` group answers with MoE routes (``shape``: layers, top-k, experts):
    the client's decode and `answer_samples` with ``return_routes``; encoding and the check not timed."""
    from hapo_megatron.rollout.sglang.client import SGLangHTTP
    from hapo_megatron.rollout.sglang.requests import answer_samples
    rng = np.random.default_rng(0)
    from hapo_megatron.rollout.routed_experts import _b64decode
    n, out = int(d["n"]), dict(json_s=0.0, samples_s=0.0, b64_s=0.0, b64_stdlib_s=0.0, gb=0.0, tokens=0, checked=0)
    for g in range(groups):
        raw, routes = group_answer(d, g, 0, routes_shape=shape, rng=rng)
        resp = http_response(raw)
        out["gb"] += len(raw) / 1e9
        del raw
        t0 = time.perf_counter()
        answer = SGLangHTTP._json(resp)
        t1 = time.perf_counter()
        smp = answer_samples(answer, [d["prompts"][g].tolist()], [(0, k) for k in range(n)], return_routes=True)
        t2 = time.perf_counter()
        encoded = [item["meta_info"]["routed_experts"] for item in answer]
        t3 = time.perf_counter()
        [_b64decode(e) for e in encoded]
        t4 = time.perf_counter()
        [base64.b64decode(e) for e in encoded]  # the decode before pybase64: the stdlib's lenient one
        t5 = time.perf_counter()
        del resp, answer, encoded
        out["json_s"] += t1 - t0
        out["samples_s"] += t2 - t1
        out["b64_s"] += t4 - t3
        out["b64_stdlib_s"] += t5 - t4
        out["checked"] += check_samples(smp, d, g, 0, routes)
        out["tokens"] += sum(len(s.response_ids) for s in smp)
        del smp, routes
    return {**out, "peak_rss_mb": peak_rss_mb()}


# --------------------------------------------------------------------------- driver
def _child(args: argparse.Namespace, role: list[str]) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--role", *role, "--out", args.out,
           *(["--no-floor"] if args.no_floor else []), "--routes-groups", str(args.routes_groups),
           *(["--routes", *map(str, args.routes)] if args.routes else []),
           "--prompts", str(args.prompts), "--n", str(args.n), "--cap", str(args.cap),
           "--chunk", str(args.chunk), "--gen-s", str(args.gen_s), "--dp", *map(str, args.dp)]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    if res.returncode:
        raise RuntimeError(f"{' '.join(role)} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def report_manager(m: dict, args: argparse.Namespace) -> None:
    tok = m["tokens"]
    gen_s = tok / (args.rollout_gpus * args.decode_tokens_per_s_per_gpu)
    host_s = m["parse_s"] + m["reward_wait_s"] + m["decode_s"] + m["rest_s"] + m["take_s"] + m["send_to_received_s"]
    print(f"\nrollout manager (one process; the producer's group path run group after group, generation "
          f"instant): {m['groups']} groups ({m['kept_groups']} kept), {m['responses']} responses, "
          f"{tok} response tokens")
    print(f"  parsed == encoded: {m['checked_tokens']} of {tok} tokens (ids, log-probs, versions, finish reasons)")
    print(f"  parse      {m['parse_s']:8.2f} s  (client JSON decode {m['json_s']:.2f} s + answer_samples "
          f"{m['samples_s']:.2f} s) of {m['answer_gb']:.2f} GB of answers with rollout log-probs")
    before = m["json_stdlib_s"] + m["samples_s"]
    print(f"             before (the client's old decode: the stdlib through requests, the collector on): JSON "
          f"{m['json_stdlib_s']:.2f} s, parse {before:.2f} s = {before / m['parse_s']:.2f}x the parse now")
    print(f"             pause_mode abort parses rows with parse_row instead of answer_samples: "
          f"{m['parse_row_s']:.2f} s")
    if m["floor_gb"]:
        print(f"             without log-probs (output_ids only; not a project path, its token ids come from "
              f"the log-prob triples): {m['floor_json_s']:.2f} s, {m['floor_gb']:.2f} GB")
    print(f"  score      {m['reward_wait_s']:8.2f} s  waiting for {m['num_workers']} reward worker(s) (math reward, "
          f"{m['responses']} responses)")
    print(f"  decode     {m['decode_s']:8.2f} s  (the responses' text for the reward: the bench's stand-in tokenizer, "
          f"a word per token)")
    print(f"  the rest   {m['rest_s']:8.2f} s  (submit to the workers, build, shape, filter, buffer)")
    print(f"  take       {m['take_s']:8.2f} s  (AsyncRollout.take_step: the batch and its metrics)")
    print(f"  transport  {m['send_to_received_s']:8.2f} s  send -> received by a rank-0 process "
          f"({m['transport_gb']:.2f} GB; pack {m['pack_s']:.2f} s, send {m['send_s']:.2f} s); "
          f"received == sent: {m['received_equal']}")
    print(f"  total      {host_s:8.2f} s of host work per step: {tok / host_s:,.0f} response tokens/s; "
          f"peak RSS {m['peak_rss_mb']:.0f} MB (rank 0's {m['rank0_peak_rss_mb']:.0f} MB)")
    print(f"\ngeneration: {tok} tokens on {args.rollout_gpus} GPUs at {args.decode_tokens_per_s_per_gpu:g} "
          f"tokens/s per GPU: {gen_s:.0f} s per step")
    verdict = "keeps up" if host_s < gen_s else "falls behind"
    print(f"the manager {verdict}: {host_s:.0f} s of host work per {gen_s:.0f} s of generation ({gen_s / host_s:.1f}x "
          f"margin); it falls behind above {tok / host_s / args.rollout_gpus:,.0f} decode tokens/s per GPU")


def report_routes(r: dict, m: dict, args: argparse.Namespace) -> None:
    layers, top_k, experts = args.routes
    g, parse_s = args.routes_groups, r["json_s"] + r["samples_s"]
    step_s = parse_s / r["tokens"] * m["tokens"]  # extrapolated by response tokens to the manager's step
    print(f"\nwith MoE routes ({layers} layers x top-{top_k} of {experts} experts; the synchronous loop's rank 0 "
          f"parses them, the asynchronous producer asks for none): {g} group answers, {r['tokens']} response "
          f"tokens, {r['gb']:.2f} GB; parsed == encoded: {r['checked']} of {r['tokens']} tokens")
    print(f"  parse {parse_s / g:.2f} s per group (client JSON decode {r['json_s'] / g:.2f} s + answer_samples "
          f"{r['samples_s'] / g:.2f} s): {r['tokens'] / parse_s:,.0f} response tokens/s, {step_s:.0f} s for the "
          f"step's {m['tokens']} tokens (extrapolated; {r['gb'] / r['tokens'] * m['tokens']:.0f} GB); "
          f"peak RSS {r['peak_rss_mb']:.0f} MB")
    before = parse_s - r["b64_s"] + r["b64_stdlib_s"]
    print(f"  before (the stdlib's base64 decode, {r['b64_stdlib_s'] / g:.2f} s per group against "
          f"{r['b64_s'] / g:.2f} s now): parse {before / g:.2f} s per group = {before / parse_s:.2f}x the parse now")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--mean", type=float, default=2500.0)
    ap.add_argument("--sigma", type=float, default=0.6)
    ap.add_argument("--cap", type=int, default=10240)
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--chunk", type=int, default=64, help="responses per /generate call")
    ap.add_argument("--gen-s", type=float, default=120.0, help="seconds over which the responses arrive")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--manager", action="store_true",
                    help="measure the rollout manager's host work instead (parse, score, transport)")
    ap.add_argument("--rollout-gpus", type=int, default=8, help="--manager: the recipe's rollout GPUs")
    ap.add_argument("--decode-tokens-per-s-per-gpu", type=float, default=3160.0,
                    help="--manager: output tokens/s per rollout GPU (docs/multinode.md's published figure)")
    ap.add_argument("--routes", type=int, nargs=3, metavar=("LAYERS", "TOP_K", "EXPERTS"),
                    help="--manager: also time the parse of --routes-groups group answers with MoE routes "
                         "(Qwen3-30B-A3B: 48 8 128), per step by extrapolation")
    ap.add_argument("--routes-groups", type=int, default=2)
    ap.add_argument("--routes-only", action="store_true", help="--routes without the manager's step (extrapolated "
                    "to the rollout's response tokens)")
    ap.add_argument("--no-floor", action="store_true",
                    help="--manager: skip the answers without log-probs (the JSON floor)")
    ap.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        with np.load(os.path.join(args.out, "rollout.npz")) as z:
            d = {k: z[k] for k in z.files}
        if args.role[0] == "routes":
            res = role_routes(d, tuple(args.routes), args.routes_groups)
        elif args.role[0] == "manager":
            res = role_manager(d, floor=not args.no_floor)
        elif args.role[0] == "rank0":
            res = role_rank0(d, args.out, args.cap, args.chunk, args.gen_s, args.dp)
        else:
            del d
            res = role_rank(args.out, int(args.role[1]), args.prompts, args.n, args.cap)
        print(json.dumps(res, default=float))
        return
    with tempfile.TemporaryDirectory(prefix="host_step_") as out:
        args.out = out
        d = synth(args.prompts, args.n, args.prompt_len, args.mean, args.sigma, args.cap, args.seed)
        np.savez(os.path.join(out, "rollout.npz"), **d)
        if args.manager:
            print(f"rollout: {args.prompts} x {args.n} responses, {int(d['lengths'].sum())} response tokens "
                  f"(mean {d['lengths'].mean():.0f}, {np.mean(d['lengths'] >= args.cap):.0%} at the cap "
                  f"{args.cap}), prompts of {args.prompt_len}; one /generate answer per group")
            if args.routes_only:
                report_routes(_child(args, ["routes"]), {"tokens": int(d["lengths"].sum())}, args)
                return
            m = _child(args, ["manager"])
            report_manager(m, args)
            if args.routes:
                report_routes(_child(args, ["routes"]), m, args)
            return
        print(f"rollout: {args.prompts} x {args.n} responses, {int(d['lengths'].sum())} response tokens "
              f"(mean {d['lengths'].mean():.0f}), prompts of {args.prompt_len}; layout {LAYOUT}; "
              f"responses arrive in chunks of {args.chunk} over {args.gen_s:.0f} s")
        r0 = _child(args, ["rank0"])
        print("\nrank 0: host seconds left after the last response")
        print(f"  {r0['after_last_response_s']:8.2f} s (results+build+filter+metrics "
              f"{r0['results+build+filter+metrics_s']:.2f} s, split+pickle for DP={args.dp[0]} "
              f"{r0['per_dp'][str(args.dp[0])]['split+pickle_s']:.2f} s; {r0['num_workers']} reward workers, "
              f"reward wait {r0['reward_wait_s']:.2f} s), {r0['kept']} responses kept, "
              f"peak RSS {r0['peak_rss_mb']:.0f} MB")
        print("\none rank (DP rank 0): receive (unpickle) + advantages + layout")
        for dp in args.dp:
            r = _child(args, ["rank", str(dp)])
            print(f"  DP={dp:<2}: receive+layout {r['receive+layout_s']:6.2f} s (receive {r['receive_s']:.2f} s), "
                  f"message {r['message_mb']:6.0f} MB, RSS growth {r['rss_growth_mb']:6.0f} MB, "
                  f"response tokens laid out {r['response_tokens_laid_out']} of {r['kept_response_tokens']} kept")


if __name__ == "__main__":
    main()
