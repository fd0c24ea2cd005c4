"""SGLangEngine up to the HTTP call, with a fake transport: payloads, parsing, spreading, retries,
dead servers, weight-sync requests and bucket contents."""

import types

import pytest
import requests
import torch

from hapo_megatron.algo import EntropyStats
from hapo_megatron.rollout.sglang import engine as se
from hapo_megatron.rollout.engine import SamplingParams
from hapo_megatron.rollout.sglang.client import SGLangError, SGLangHTTP, ServerDiedError, ServerHandle
from hapo_megatron.rollout.sglang.launch import server_command, sglang_dtype
from hapo_megatron.rollout.sglang.processor import PARAM_KEY, SGLANG_AVAILABLE, AdaptiveTemperatureProcessor

from .collective_worker import named_weights
from .fake_sglang import FakeProcess, FakeSession
from tests.rollout.sglang.engines import sglang_engine

STATS = EntropyStats(pivot=1.1, std=0.4, pos_max=2.0, neg_min=-2.5)
URLS = ["http://a:1", "http://b:2"]


def engine(session, **kw):
    kw.setdefault("server_urls", URLS)
    kw.setdefault("colocate", False)
    kw.setdefault("weight_sync", "disk")
    return sglang_engine(session=session, launch=False, **kw)


# ---------------------------------------------------------------- payloads and parsing
def test_generate_payload_adaptive_and_plain():
    params = SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=5, max_new_tokens=7, stop_token_ids=(3,),
                            adaptive=True, entropy_stats=STATS, temperature_tau=0.1, h_hat_mode="reference", seed=9)
    body = se.generate_payload([[1, 2], [3]], params, seeds=se.row_seeds(params, [0, 1]))
    assert body["input_ids"] == [[1, 2], [3]] and body["return_logprob"] is True
    assert body["custom_logit_processor"] == [AdaptiveTemperatureProcessor.to_str()] * 2
    sp = body["sampling_params"][0]
    assert {k: sp[k] for k in ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids")} == {
        "temperature": 0.8, "top_p": 0.9, "top_k": 5, "max_new_tokens": 7, "stop_token_ids": [3]}
    # the request temperature and the processor's base temperature are the same number
    assert sp["custom_params"] == AdaptiveTemperatureProcessor.custom_params(STATS, 0.8, 0.1, "reference")
    assert sp["custom_params"][PARAM_KEY]["base_temperature"] == sp["temperature"]
    assert [s["sampling_seed"] for s in body["sampling_params"]] == se.row_seeds(params, [0, 1])
    assert len(set(se.row_seeds(params, range(10)))) == 10
    plain = se.generate_payload([[1]], params.with_(adaptive=False))
    assert "custom_logit_processor" not in plain and "custom_params" not in plain["sampling_params"][0]
    assert "sampling_seed" not in plain["sampling_params"][0]
    greedy = se.generate_payload([[1]], params.with_(temperature=0.0))
    assert "custom_logit_processor" not in greedy  # greedy never uses the processor
    with pytest.raises(ValueError, match="seeds"):
        se.generate_payload([[1]], params, seeds=[1, 2])


@pytest.mark.skipif(not SGLANG_AVAILABLE, reason="sglang not installed")
def test_generate_payload_passes_sglang_request_contract():
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, adaptive=True,
                            entropy_stats=EntropyStats.neutral(), temperature_tau=0.05, h_hat_mode="signed", seed=1,
                            stop_token_ids=(2,))
    assert generate_contract_error(se.generate_payload([[1, 2], [4]], params, seeds=[5, 6])) is None
    assert generate_contract_error(se.generate_payload([[1]], params.with_(adaptive=False))) is None


def test_parse_generate_item():
    item = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "stop", "matched": 6},
                                                 "output_token_logprobs": [[-0.5, 5, None], [-1.5, 6, None]]}}
    assert se.parse_generate_item(item) == ([5, 6], [-0.5, -1.5], "stop")
    item["meta_info"]["finish_reason"] = {"type": "length", "length": 2}
    assert se.parse_generate_item(item)[2] == "length"
    with pytest.raises(SGLangError, match="abort"):
        se.parse_generate_item({"meta_info": {"finish_reason": {"type": "abort", "message": "x"}}})
    with pytest.raises(SGLangError, match="output_token_logprobs"):
        se.parse_generate_item({"meta_info": {"finish_reason": {"type": "stop"}}})
    with pytest.raises(SGLangError, match="disagree"):
        se.parse_generate_item(dict(item, output_ids=[5]))
    with pytest.raises(SGLangError):
        se.parse_generate_item(["not a dict"])


# ---------------------------------------------------------------- generation
def test_generate_orders_samples_and_spreads_requests():
    sess = FakeSession()
    eng = engine(sess, requests_per_call=3)
    prompts = [[10], [20, 1], [30], [40]]
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=4, stop_token_ids=(22,),
                            adaptive=True, entropy_stats=STATS, temperature_tau=0.05, h_hat_mode="signed")
    out = eng.generate(prompts, params)
    assert [[(s.prompt_index, s.sample_index) for s in g] for g in out] == [[(p, 0), (p, 1)] for p in range(4)]
    for p, g in enumerate(out):
        for s in g:
            assert s.prompt_ids.tolist() == prompts[p]
            assert s.temperatures.tolist() == [] and not s.has_temperatures  # SGLang cannot report them
            assert s.rollout_logprobs == pytest.approx([-0.1 * (i + 1) for i in range(len(s.response_ids))])
    assert out[1][0].response_ids.tolist() == [21, 22] and out[1][0].finish_reason == "stop"
    assert out[0][0].response_ids.tolist() == [11, 12, 13, 14] and out[0][0].finish_reason == "length"
    gens = sess.posts("/generate")
    assert sorted(len(b["input_ids"]) for _, b in gens) == [2, 3, 3]  # 8 rows in chunks of 3
    assert {u.rsplit("/", 1)[0] for u, _ in gens} == set(URLS)  # both servers used
    # every row's custom params reached the server
    assert all(sp["custom_params"][PARAM_KEY]["pivot"] == STATS.pivot for _, b in gens for sp in b["sampling_params"])


def test_generate_bad_input():
    eng = engine(FakeSession())
    with pytest.raises(ValueError, match="params"):
        eng.generate([[1]], {"n": 1})
    with pytest.raises(ValueError, match="prompt_ids"):
        eng.generate([[]], SamplingParams(temperature=1.0, top_p=1.0, top_k=-1))


# ---------------------------------------------------------------- retries and dead servers
def test_retries_with_backoff_then_success():
    sleeps = []
    sess = FakeSession(failures={"/generate": [503, requests.ConnectionError("reset"), 502]})
    http = SGLangHTTP(max_retries=3, backoff_s=0.5, session=sess, sleep=sleeps.append, timeout_s=600.0)
    ans = http.request(ServerHandle(URLS[0]), "/generate",
                       {"input_ids": [[1]], "sampling_params": [{"max_new_tokens": 1}]})
    assert len(ans) == 1 and sleeps == [0.5, 1.0, 2.0]


def test_retries_exhausted_and_non_retryable():
    sleeps = []
    sess = FakeSession(failures={"/generate": [503] * 10, "/update_weights_from_disk": [400]})
    http = SGLangHTTP(max_retries=2, backoff_s=1.0, session=sess, sleep=sleeps.append, timeout_s=600.0)
    with pytest.raises(SGLangError, match="after 3 attempt"):
        http.request(ServerHandle(URLS[0]), "/generate", {})
    assert len(sess.posts("/generate")) == 3 and sleeps == [1.0, 2.0]
    with pytest.raises(SGLangError, match="HTTP 400"):
        http.request(ServerHandle(URLS[0]), "/update_weights_from_disk", {})
    assert len(sess.posts("/update_weights_from_disk")) == 1  # 4xx: no retry


def test_dead_launched_server_raises_with_log_tail(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("CUDA out of memory while loading weights\n")
    dead = ServerHandle("http://a:1", process=FakeProcess(returncode=-9), log_path=str(log))
    http = SGLangHTTP(session=FakeSession(), sleep=lambda s: None, timeout_s=600.0, max_retries=3)
    with pytest.raises(ServerDiedError, match="exited with code -9(.|\n)*CUDA out of memory"):
        http.request(dead, "/generate", {})
    with pytest.raises(ServerDiedError, match="start-up"):
        http.wait_healthy(dead, timeout_s=10)


def test_dead_attached_servers_are_named_when_none_is_left():
    """Every server refuses connections: each is taken out of use in turn (attached: nothing to
    restart), and the error names them all (rollout/sglang/server_supervisor.py)."""
    sess = FakeSession(down=set(URLS))
    eng = engine(sess, max_retries=1, wait_for_servers=False)
    eng.http.sleep = lambda s: None
    with pytest.raises(ServerDiedError, match="no SGLang server left in use.*http://a:1: lost, http://b:2: lost"):
        eng.generate([[1]] * 4, SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=2))


def test_attach_waits_for_servers_to_become_healthy():
    sess = FakeSession()
    engine(sess)
    assert [u for m, u, _ in sess.calls if m == "GET"] == [u + "/health" for u in URLS]


def test_wait_healthy_times_out():
    now = [0.0]

    def sleep(s):
        now[0] += s

    http = SGLangHTTP(session=FakeSession(dead={URLS[0]}), sleep=sleep, timeout_s=600.0, max_retries=3)
    with pytest.raises(SGLangError, match="not healthy after 10 s"):
        http.wait_healthy(ServerHandle(URLS[0]), timeout_s=10, poll_s=3, clock=lambda: now[0])


# ---------------------------------------------------------------- weight sync requests
def test_disk_sync_writes_checkpoint_and_posts_every_server(tmp_path):
    from safetensors.torch import load_file

    sess = FakeSession()
    eng = engine(sess, weight_sync="disk", disk_sync_dir=str(tmp_path / "w"), bucket_size_mb=1)
    eng.update_weights(iter(named_weights()))
    posts = sess.posts("/update_weights_from_disk")
    assert [u.rsplit("/", 1)[0] for u, _ in posts] == URLS
    assert all(b == {"model_path": str(tmp_path / "w"), "flush_cache": True} for _, b in posts)
    loaded = {}
    for f in sorted((tmp_path / "w").glob("*.safetensors")):
        loaded.update(load_file(str(f)))
    assert all(torch.equal(loaded[n], t) for n, t in named_weights())


def test_distributed_sync_payloads_and_broadcast_order(monkeypatch):
    sess = FakeSession()
    eng = engine(sess, weight_sync="distributed", bucket_size_mb=1)
    eng._nccl_group, eng._sync_device = "fake-group", "cpu"
    sent = []
    monkeypatch.setattr(torch.distributed, "broadcast",
                        lambda t, group=None, group_src=None: sent.append((t.clone(), group, group_src)))
    eng.bucket_bytes = 64 * 32 * 2 + 100  # one big tensor (+ the small norm) per bucket
    eng.update_weights(iter(named_weights()))
    posts = sess.posts("/update_weights_from_distributed")
    assert len(posts) == 2 * len(sent)  # each bucket announced to both servers, broadcast once
    bodies = [b for _, b in posts[::2]]
    assert [b["names"] for b in bodies] == [["model.embed_tokens.weight"], ["model.layers.0.mlp.up_proj.weight",
                                            "model.norm.weight"], ["lm_head.weight"]]
    assert all(b["dtypes"] == ["bfloat16"] * len(b["names"]) and b["load_format"] == "flattened_bucket" for b in bodies)
    assert [b["flush_cache"] for b in bodies] == [False, False, True]  # flush once, at the end
    flat_all = torch.cat([t for t, _, _ in sent])
    want = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named_weights()])
    assert torch.equal(flat_all, want) and all(g == "fake-group" and s == 0 for _, g, s in sent)


@pytest.mark.skipif(not SGLANG_AVAILABLE, reason="sglang not installed")
def test_tensor_sync_single_process_payloads():
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    sess = FakeSession()
    eng = engine(sess, server_urls=URLS[:1], colocate=True, weight_sync="auto", server_tp_size=2,
                 bucket_size_mb=1)
    assert eng.weight_sync == "tensor"
    eng.bucket_bytes = 64 * 32 * 2
    eng.update_weights(iter(named_weights()))
    posts = sess.posts("/update_weights_from_tensor")
    got = []
    for _, body in posts:
        assert body["load_format"] == "flattened_bucket" and len(body["serialized_named_tensors"]) == 2
        data = MultiprocessingSerializer.deserialize(body["serialized_named_tensors"][0])
        got.append(FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"],
                                         metadata=data["metadata"]).reconstruct_tensors())
    assert [b["flush_cache"] for _, b in posts] == [False] * (len(posts) - 1) + [True]
    flat = [x for b in got for x in b]
    assert [n for n, _ in flat] == [n for n, _ in named_weights()]
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, w) for (_, t), (_, w) in zip(flat, named_weights()))


@pytest.mark.skipif(not SGLANG_AVAILABLE, reason="sglang not installed")
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_sync_serializes_once_per_server_tp_rank(monkeypatch, tp):
    """One process, one server of TP=tp: every payload holds tp DISTINCT serialisations (each TP
    rank deserialises only its own: one CUDA-IPC reference each), all of the same flattened bucket."""
    from hapo_megatron.rollout.sglang import weight_sync as ws
    calls = []

    def recording(obj):  # a serialisation is identified by its call, as CUDA-IPC references are
        calls.append(obj["flattened_tensor"])
        return f"serialization-{len(calls)}"
    monkeypatch.setattr(ws, "serialize_by_value", recording)
    sess = FakeSession()
    eng = engine(sess, server_urls=URLS[:1], colocate=True, weight_sync="tensor", server_tp_size=tp)
    eng.bucket_bytes = 64 * 32 * 2
    eng.update_weights(iter(named_weights()))
    posts = [b["serialized_named_tensors"] for _, b in sess.posts("/update_weights_from_tensor")]
    assert len(posts) > 1
    for i, entries in enumerate(posts):
        assert len(entries) == tp and len(set(entries)) == tp, entries
        flats = calls[i * tp:(i + 1) * tp]
        assert all(f is flats[0] for f in flats)  # the bucket is flattened once, serialised tp times
    assert len(calls) == tp * len(posts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA-IPC serialisation)")
def test_cuda_serializations_per_rank_differ_and_each_decodes():
    pytest.importorskip("sglang.srt.utils")
    from hapo_megatron.rollout.sglang import weight_sync as ws
    bucket = [(n, t.cuda()) for n, t in named_weights()]
    blobs, keepalive = ws.serialize_bucket_for_sglang(bucket, 2)
    assert len(blobs) == 2 and blobs[0] != blobs[1]  # separate CUDA-IPC references
    assert keepalive.is_cuda


def test_release_resume_only_when_colocated():
    sess = FakeSession()
    eng = engine(sess, colocate=True, weight_sync="disk", device="cuda")
    eng.release_memory()
    eng.resume_memory(tags=["weights"])
    assert [b for _, b in sess.posts("/release_memory_occupation")] == [{"tags": None}] * 2
    assert [b for _, b in sess.posts("/resume_memory_occupation")] == [{"tags": ["weights"]}] * 2
    sess2 = FakeSession()
    eng2 = engine(sess2, colocate=False, device="cuda")
    eng2.release_memory()
    eng2.resume_memory()
    assert [c for c in sess2.calls if c[0] == "POST"] == []
    sess3 = FakeSession()  # CPU servers: nothing to free, no memory saver -> no request at all
    eng3 = engine(sess3, colocate=True, device="cpu")
    eng3.release_memory()
    eng3.resume_memory()
    assert [c for c in sess3.calls if c[0] == "POST"] == []


# ---------------------------------------------------------------- config, launch commands
def test_the_section_reaches_the_engine_and_weight_sync_resolution():
    from hapo_megatron.config import SGLangConfig

    cfg = SGLangConfig(server_urls=URLS, colocate=False, weight_sync="auto", bucket_size_mb=8, max_retries=5,
                       request_timeout_s=7.0, server_tp_size=2)
    plain = dict(quantization="none", kv_cache_dtype="auto")
    eng = se.SGLangEngine(cfg, model_path="/m", session=FakeSession(), launch=False, **plain)
    assert (eng.weight_sync, eng.bucket_bytes, eng.http.max_retries, len(eng.servers)) == ("distributed", 8 << 20, 5, 2)
    assert (eng.http.timeout_s, eng.tp, [s.tp_size for s in eng.servers]) == (7.0, 2, [2, 2])
    dropped = types.SimpleNamespace(**{k: v for k, v in vars(cfg).items() if k != "request_timeout_s"})
    with pytest.raises(AttributeError, match="request_timeout_s"):  # strict wiring: no silent default
        se.SGLangEngine(dropped, model_path="/m", session=FakeSession(), launch=False, **plain)
    assert se.resolve_weight_sync("auto", colocate=True) == "tensor"
    with pytest.raises(ValueError, match="colocate"):
        se.resolve_weight_sync("tensor", colocate=False)
    with pytest.raises(ValueError, match="weight_sync"):
        se.resolve_weight_sync("nccl", colocate=False)
    with pytest.raises(ValueError, match="launch=False"):
        sglang_engine(server_urls=[], launch=False, session=FakeSession())


def test_launch_commands():
    cmd = server_command("/models/q", port=30001, tp_size=2, base_gpu_id=4, mem_fraction_static=0.6,
                         dtype=sglang_dtype(torch.bfloat16), enable_memory_saver=True, extra_args=["--x", 1],
                             quantization='none', kv_cache_dtype='auto')
    s = " ".join(cmd)
    for part in ("--model-path /models/q", "--port 30001", "--tp-size 2",
                 "--base-gpu-id 4", "--mem-fraction-static 0.6", "--dtype bfloat16",
                 "--enable-custom-logit-processor", "--enable-memory-saver", "--skip-tokenizer-init"):
        assert part in s
    assert cmd[-2:] == ["--x", "1"]
    # keyed (default): sglang.launch_server run with the key flags added from the environment
    assert cmd[1] == "-c" and "'sglang.launch_server'" in cmd[2] and "'--admin-api-key'" in cmd[2]
    assert "-m sglang.launch_server --model-path /m" in " ".join(server_command("/m", port=1, api_key=False,
        mem_fraction_static=0.7, quantization='none', kv_cache_dtype='auto'))
    assert "--enable-memory-saver" not in server_command("/m", port=1,
        mem_fraction_static=0.7, quantization='none', kv_cache_dtype='auto')
    assert sglang_dtype("bf16") == "bfloat16" and sglang_dtype(torch.float32) == "float32"
    with pytest.raises(ValueError):
        sglang_dtype(torch.int8)


# ---------------------------------------------------------------- collective behaviour (2 gloo ranks)
def test_collective_generate_and_weight_sync_on_two_ranks(tmp_path):
    from tests.distributed import run_distributed

    from .collective_worker import collective_worker

    r0, r1 = run_distributed(collective_worker, 2, str(tmp_path / "w"), timeout=120)
    assert r0["samples"] == r1["samples"] == [[[11, 12, 13]] * 2, [[21, 22, 23]] * 2]
    assert (r0["generate_posts"], r1["generate_posts"]) == (1, 0)  # only rank 0 talks to the servers
    bearer = {"Authorization": "Bearer key-known-to-rank-0"}
    assert r0["auth"] == r1["auth"] == {"headers": bearer}  # rank 0's key, broadcast to rank 1
    assert r0["sent_headers"] and set(map(str, r0["sent_headers"])) == {str(bearer)}
    names = [n for n, _ in named_weights()]
    assert r0["tensor_posts"] == [[f"rank0:{n}", f"rank1:{n}"] for n in names]  # server TP rank order
    assert r1["tensor_posts"] == []
    assert (r0["release_posts"], r1["release_posts"]) == (1, 0)
    assert (r0["disk_posts"], r1["disk_posts"]) == (2, 0)
    assert r0["drained"] == r1["drained"] == len(names)
    assert r0["solo_tensor_posts"] == [[f"rank0:{n}"] * 2 for n in names]  # same handle for both TP ranks


# ---------------------------------------------------------------- weight-update sessions (SGLang >= 0.5.23)
def _post_paths(sess):
    return ["/" + u.split("/", 3)[-1] for m, u, _ in sess.calls if m == "POST"]


@pytest.mark.skipif(not SGLANG_AVAILABLE, reason="sglang not installed")
def test_tensor_sync_runs_inside_a_weight_update_session():
    sess = FakeSession()
    eng = engine(sess, server_urls=URLS[:1], colocate=True, weight_sync="tensor")
    eng.bucket_bytes = 64 * 32 * 2
    eng.update_weights(iter(named_weights()))
    paths = _post_paths(sess)
    assert paths[0] == "/begin_weight_update" and paths[-1] == "/end_weight_update"
    assert set(paths[1:-1]) == {"/update_weights_from_tensor"} and len(paths) > 3


@pytest.mark.skipif(not SGLANG_AVAILABLE, reason="sglang not installed")
def test_server_without_session_endpoints_is_updated_without_them():
    sess = FakeSession(failures={"/begin_weight_update": [404]})  # an older SGLang
    eng = engine(sess, server_urls=URLS[:1], colocate=True, weight_sync="tensor")
    eng.update_weights(iter(named_weights()))
    eng.update_weights(iter(named_weights()))
    paths = _post_paths(sess)
    assert paths.count("/begin_weight_update") == 1  # detected once, remembered
    assert "/end_weight_update" not in paths and paths.count("/update_weights_from_tensor") == 2


@pytest.mark.skipif(not SGLANG_AVAILABLE, reason="sglang not installed")
def test_refused_update_names_server_endpoint_and_status_and_closes_the_session():
    sess = FakeSession(failures={"/update_weights_from_tensor": [400]})
    eng = engine(sess, server_urls=URLS[:1], colocate=True, weight_sync="tensor")
    with pytest.raises(SGLangError, match=r"http://a:1 refused POST /update_weights_from_tensor: HTTP 400"):
        eng.update_weights(iter(named_weights()))
    assert _post_paths(sess)[-1] == "/end_weight_update"  # not left open


def test_distributed_sync_runs_inside_a_session(monkeypatch):
    sess = FakeSession()
    eng = engine(sess, weight_sync="distributed")
    eng._nccl_group, eng._sync_device = "fake-group", "cpu"
    monkeypatch.setattr(torch.distributed, "broadcast", lambda t, group=None, group_src=None: None)
    eng.update_weights(iter(named_weights()))
    paths = _post_paths(sess)
    assert paths[:2] == ["/begin_weight_update"] * 2 and paths[-2:] == ["/end_weight_update"] * 2


def test_cpu_payload_is_pickled_by_value_and_accepted_by_sglangs_safe_unpickler():
    pytest.importorskip("sglang.srt.utils")
    from sglang.srt.utils import MultiprocessingSerializer

    from hapo_megatron.rollout.sglang import weight_sync as ws

    (blob,), _ = ws.serialize_bucket_for_sglang(named_weights())
    data = MultiprocessingSerializer.deserialize(blob)  # the server's SafeUnpickler
    assert torch.equal(data["flattened_tensor"],
                       torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named_weights()]))
    assert [m.name for m in data["metadata"]] == [n for n, _ in named_weights()]


# ---------------------------------------------------------------- bind policy
def test_launched_servers_bind_loopback_on_one_node(monkeypatch, tmp_path):
    from hapo_megatron.rollout.sglang import launch as sglang_launch

    started = []

    def fake_start(cmd, url, **kw):
        started.append((cmd, url, kw["env"]))
        return ServerHandle(url=url)

    monkeypatch.setattr(sglang_launch, "start_process", fake_start)
    monkeypatch.setenv("RANK", "0")  # as under torchrun: must not reach the server
    monkeypatch.setenv("MASTER_PORT", "29500")
    sglang_engine(model_path=str(tmp_path), num_servers=2, session=FakeSession(), log_dir=str(tmp_path),
                    port_base=31000, device="cpu", weight_sync="disk")
    assert [url for _, url, _ in started] == ["http://127.0.0.1:31000", "http://127.0.0.1:31001"]
    for cmd, _, env in started:
        assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and "0.0.0.0" not in cmd
        assert env["SGLANG_USE_CPU_ENGINE"] == "1" and "--device" in cmd and "torch_native" in cmd
        assert "--sleep-on-idle" in cmd  # an idle CPU scheduler would busy-poll a core of the trainer's
        assert "RANK" not in env and "MASTER_PORT" not in env
    assert server_command("/m", port=1,
        mem_fraction_static=0.7, quantization='none', kv_cache_dtype='auto')[server_command("/m", port=1,
        mem_fraction_static=0.7, quantization='none', kv_cache_dtype='auto').index("--host") + 1] == "127.0.0.1"


def test_generate_hands_each_call_to_on_samples():
    eng = engine(FakeSession(), requests_per_call=3)
    prompts = [[10], [20, 1], [30], [40]]
    chunks = []
    out = eng.generate(prompts, SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=4),
                       on_samples=chunks.append)
    assert sorted(len(c) for c in chunks) == [2, 3, 3]  # one hand-over per /generate call
    handed = sorted(((s.prompt_index, s.sample_index), s.response_ids) for c in chunks for s in c)
    assert handed == sorted(((s.prompt_index, s.sample_index), s.response_ids) for g in out for s in g)
    assert [[s is t for s, t in zip(g, [x for c in chunks for x in c if x.prompt_index == p])]
            for p, g in enumerate(out)] == [[True, True]] * 4  # the very samples returned, in order
