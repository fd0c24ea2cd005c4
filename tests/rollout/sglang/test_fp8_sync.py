"""`rollout.quantization` / `rollout.kv_cache_dtype` on their way to the servers, and FP8 weight
syncs in each mode (docs/fp8.md), with a fake SGLang transport. Each wiring test names the
mutation it was checked against."""

import json

import pytest
import torch

from hapo_megatron.config import HapoConfig
from hapo_megatron.config.sections import RolloutConfig, SGLangConfig
from hapo_megatron.models import tiny_hf_config
from hapo_megatron.models.hf_config import write_tiny_char_model
from hapo_megatron.rollout import make_engine
from hapo_megatron.rollout.fp8 import FP8_DTYPE, quantize_blockwise
from hapo_megatron.rollout.sglang.fp8_serving import CPU_FP8_REFUSED
from hapo_megatron.rollout.fp8_weights import is_fp8_weight, scale_name
from hapo_megatron.rollout.sglang.client import ServerHandle
from hapo_megatron.rollout.sglang.launch import server_command
from hapo_megatron.rollout.sglang.processor import SGLANG_AVAILABLE

from .fake_sglang import FakeSession
from tests.rollout.sglang.engines import sglang_engine

URLS = ["http://a:1", "http://b:2"]
FP8_NAME = "model.layers.0.self_attn.q_proj.weight"


def named_weights():
    """A norm, two FP8 weights (one with partial 128-blocks) and the output layer, bf16."""
    g = torch.Generator().manual_seed(0)
    return [("model.embed_tokens.weight", torch.randn(64, 32, generator=g).bfloat16()),
            (FP8_NAME, torch.randn(256, 160, generator=g).bfloat16()),
            ("model.layers.0.input_layernorm.weight", torch.randn(160, generator=g).bfloat16()),
            ("model.layers.0.mlp.experts.3.down_proj.weight", torch.randn(160, 300, generator=g).bfloat16()),
            ("lm_head.weight", torch.randn(64, 32, generator=g).bfloat16())]


def expected_stream():
    """What an FP8 server must receive: each FP8 weight as (q, scale), the rest as is."""
    out = {}
    for n, t in named_weights():
        if is_fp8_weight(n):
            out[n], out[scale_name(n)] = quantize_blockwise(t)
        else:
            out[n] = t
    return out


def assert_fp8_stream(got: dict):
    want = expected_stream()
    assert set(got) == set(want)
    for n, t in want.items():
        assert got[n].dtype == t.dtype and got[n].shape == t.shape, n
        assert torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)), n  # bit for bit


def engine(session, **kw):
    kw.setdefault("server_urls", URLS)
    kw.setdefault("colocate", False)
    kw.setdefault("weight_sync", "disk")
    kw.setdefault("quantization", "fp8")
    return sglang_engine(session=session, launch=False, **kw)


# ------------------------------------------------------------------------------- config
def test_config_fields_defaults_and_refusals():
    cfg = HapoConfig()
    assert cfg.rollout.quantization == "none" and cfg.rollout.kv_cache_dtype == "auto"
    ok = HapoConfig.from_dict({"rollout": {"engine": "sglang", "quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}})
    assert ok.rollout.quantization == "fp8" and ok.rollout.kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="rollout.quantization must be one of"):
        HapoConfig.from_dict({"rollout": {"engine": "sglang", "quantization": "int4"}})
    with pytest.raises(ValueError, match="rollout.kv_cache_dtype must be one of"):
        HapoConfig.from_dict({"rollout": {"engine": "sglang", "kv_cache_dtype": "fp16"}})
    for field, value in (("quantization", "fp8"), ("kv_cache_dtype", "fp8_e4m3")):
        with pytest.raises(ValueError, match=f"rollout.{field}=.*needs rollout.engine='sglang'"):
            HapoConfig.from_dict({"rollout": {"engine": "hf", field: value}})


# ------------------------------------------------------------------------------- server flags
def test_server_command_flags():
    """`--quantization fp8` / `--kv-cache-dtype` only when set (mutation: flags never added)."""
    plain = server_command("/m", port=1, device="cuda",
        mem_fraction_static=0.7, quantization='none', kv_cache_dtype='auto')
    assert "--quantization" not in plain and "--kv-cache-dtype" not in plain
    cmd = server_command("/m", port=1, device="cuda", quantization="fp8", kv_cache_dtype="fp8_e4m3",
        mem_fraction_static=0.7)
    assert cmd[cmd.index("--quantization") + 1] == "fp8" and cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8_e4m3"


def fp8_ready_model(path, arch: str = "qwen3") -> str:
    """A tiny model whose FP8 matrices are whole 128-blocks (experts of FFN 128 for Qwen3-MoE)."""
    moe = {"moe_intermediate_size": 128} if arch == "qwen3_moe" else {}
    write_tiny_char_model(str(path), arch, seed=0, dtype=torch.bfloat16, hidden_size=128, intermediate_size=256,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=128, **moe)
    return str(path)


def test_launched_fp8_servers_start_from_an_fp8_checkpoint_with_the_flags(monkeypatch, tmp_path):
    """A launched server gets `--quantization fp8`, `--kv-cache-dtype` and a model directory
    holding FP8 weights with the quantization_config (mutations: quantization / kv_cache_dtype not
    passed to launch_server; the original bf16 model_path launched)."""
    from hapo_megatron.rollout.sglang import launch as sglang_launch

    started = []
    monkeypatch.setattr(sglang_launch, "start_process",
                        lambda cmd, url, **kw: started.append(cmd) or ServerHandle(url=url))
    model = fp8_ready_model(tmp_path / "model")
    sglang_engine(model_path=model, num_servers=1, session=FakeSession(), log_dir=str(tmp_path / "logs"),
                    device="cuda", weight_sync="disk", quantization="fp8", kv_cache_dtype="fp8_e4m3")
    (cmd,) = started
    assert cmd[cmd.index("--quantization") + 1] == "fp8" and cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    served = cmd[cmd.index("--model-path") + 1]
    assert served != model
    assert json.load(open(f"{served}/config.json"))["quantization_config"]["weight_block_size"] == [128, 128]
    from hapo_megatron.convert import HFCheckpointReader
    assert HFCheckpointReader(served)["model.layers.0.mlp.up_proj.weight"].dtype == FP8_DTYPE


def test_fp8_launch_refuses_cpu_servers_float32_and_unservable_shapes(monkeypatch, tmp_path):
    from hapo_megatron.rollout.sglang import launch as sglang_launch

    monkeypatch.setattr(sglang_launch, "start_process", lambda cmd, url, **kw: ServerHandle(url=url))
    model = fp8_ready_model(tmp_path / "model")
    kw = dict(model_path=model, num_servers=1, session=FakeSession(), log_dir=str(tmp_path / "logs"),
              weight_sync="disk", quantization="fp8")
    with pytest.raises(ValueError, match="needs CUDA servers"):
        sglang_engine(device="cpu", **kw)
    assert "AMX" in CPU_FP8_REFUSED
    with pytest.raises(ValueError, match="bf16 or fp16"):
        sglang_engine(device="cuda", dtype=torch.float32, **kw)
    tiny = tmp_path / "tiny"
    write_tiny_char_model(str(tiny), "qwen3", seed=0)  # hidden 32: no whole 128-blocks
    with pytest.raises(ValueError, match="block-FP8 layers cannot hold"):
        sglang_engine(device="cuda", **{**kw, "model_path": str(tiny)})
    with pytest.raises(ValueError, match="quantization must be one of"):
        sglang_engine(device="cuda", **{**kw, "quantization": "fp4"})


def test_fp8_launch_refuses_llama(monkeypatch, tmp_path):
    """SGLang 0.5.23's LlamaForCausalLM renames weight_scale_inv to weight_scale and would drop the
    block scales: refused before any server starts; Qwen2 / Qwen3 / Qwen3-MoE are served."""
    from hapo_megatron.rollout.sglang import launch as sglang_launch
    from hapo_megatron.rollout.sglang.fp8_serving import serving_model_path

    monkeypatch.setattr(sglang_launch, "start_process", lambda cmd, url, **kw: ServerHandle(url=url))
    llama = fp8_ready_model(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="cannot serve LlamaForCausalLM: SGLang 0.5.23's Llama loader renames"):
        sglang_engine(model_path=llama, num_servers=1, session=FakeSession(), log_dir=str(tmp_path / "logs"),
                        weight_sync="disk", quantization="fp8", device="cuda")
    assert serving_model_path(llama, "none", str(tmp_path)) == llama
    for arch in ("qwen2", "qwen3_moe"):
        served = serving_model_path(fp8_ready_model(tmp_path / arch, arch), "fp8", str(tmp_path / f"w_{arch}"))
        assert json.load(open(f"{served}/config.json"))["quantization_config"]["quant_method"] == "fp8"
    with pytest.raises(ValueError, match="local model directory"):
        serving_model_path("Qwen/Qwen3-8B", "fp8", str(tmp_path))


def test_make_engine_and_build_engine_carry_the_settings(monkeypatch, tmp_path):
    """From the config to the engine (make_engine) and to the trainer's servers (build_engine ->
    start_node_servers) (mutations: factory drops rollout.quantization / kv_cache_dtype; build
    does not pass them)."""
    rollout = RolloutConfig(engine="sglang", quantization="fp8", kv_cache_dtype="fp8_e5m2",
                            sglang=SGLangConfig(server_urls=URLS, colocate=False, weight_sync="disk"))
    eng = make_engine(rollout, hf_config_or_path=str(tmp_path), session=FakeSession())
    assert (eng.quantization, eng.kv_cache_dtype) == ("fp8", "fp8_e5m2")

    from hapo_megatron.training import build

    seen = {}
    monkeypatch.setattr(build, "start_node_servers", lambda cfg, **kw: seen.update(kw))
    monkeypatch.setenv("HAPO_SGLANG_SYNC_DIR", str(tmp_path / "sync"))
    cfg = HapoConfig.from_dict({"model": {"hf_model_path": str(tmp_path)}, "trainer": {"run_dir": str(tmp_path)},
                                "rollout": {"engine": "sglang", "quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}})
    build.build_engine(cfg, tiny_hf_config("qwen3"), None)
    assert (seen["quantization"], seen["kv_cache_dtype"]) == ("fp8", "fp8_e4m3")


# ------------------------------------------------------------------------------- syncs
def test_disk_sync_writes_fp8_pairs_and_the_quantization_config(tmp_path):
    """Mutation: the stream not quantised (bf16 weights, no scales) / config not marked."""
    from hapo_megatron.convert import load_hf_state_dict

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    sess = FakeSession()
    eng = engine(sess, disk_sync_dir=str(tmp_path / "w"), model_path=str(model))
    eng.update_weights(iter(named_weights()))
    assert [b for _, b in sess.posts("/update_weights_from_disk")] == [
        {"model_path": str(tmp_path / "w"), "flush_cache": True}] * 2
    assert_fp8_stream(load_hf_state_dict(str(tmp_path / "w")))
    config = json.loads((tmp_path / "w" / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}


def test_distributed_sync_broadcasts_fp8_pairs_in_one_dtype_buckets(monkeypatch):
    """The NCCL path: announced names / dtypes / shapes match the broadcast bytes, one dtype per
    bucket (mutation: the plain dtype-change bucketing: one request per tensor)."""
    sess = FakeSession()
    eng = engine(sess, weight_sync="distributed", bucket_size_mb=1)
    eng._nccl_group, eng._sync_device = "fake-group", "cpu"
    sent = []
    monkeypatch.setattr(torch.distributed, "broadcast", lambda t, group=None, group_src=None: sent.append(t.clone()))
    eng.update_weights(iter(named_weights()))
    bodies = [b for _, b in sess.posts("/update_weights_from_distributed")[::2]]
    assert len(bodies) == len(sent) == 3  # bf16, float8, float32
    got = {}
    for body, flat in zip(bodies, sent):
        assert len(set(body["dtypes"])) == 1
        offset = 0
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
            dt = getattr(torch, dtype)
            size = dt.itemsize * int(torch.Size(shape).numel())
            got[name] = flat[offset:offset + size].view(dt).reshape(shape)
            offset += size
    assert {b["dtypes"][0] for b in bodies} == {"bfloat16", "float8_e4m3fn", "float32"}
    assert_fp8_stream(got)
    assert [b["flush_cache"] for b in bodies] == [False, False, True]


@pytest.mark.skipif(not SGLANG_AVAILABLE, reason="sglang not installed")
def test_tensor_sync_sends_fp8_pairs_sglang_reconstructs():
    """The CUDA-IPC path (CPU tensors by value here): SGLang's own FlattenedTensorBucket rebuilds
    the FP8 pairs bit for bit (mutation: quantisation skipped in this mode)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    sess = FakeSession()
    eng = engine(sess, server_urls=URLS[:1], colocate=True, weight_sync="tensor")
    eng.update_weights(iter(named_weights()))
    got = {}
    for _, body in sess.posts("/update_weights_from_tensor"):
        data = MultiprocessingSerializer.deserialize(body["serialized_named_tensors"][0])
        got.update(FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"],
                                         metadata=data["metadata"]).reconstruct_tensors())
    assert_fp8_stream(got)


def test_unquantised_engine_sends_the_weights_as_they_are(tmp_path):
    """quantization="none" (the default) leaves the stream alone: no scales, bf16 weights."""
    from hapo_megatron.convert import load_hf_state_dict

    eng = engine(FakeSession(), disk_sync_dir=str(tmp_path / "w"), quantization="none")
    eng.update_weights(iter(named_weights()))
    got = load_hf_state_dict(str(tmp_path / "w"))
    assert set(got) == {n for n, _ in named_weights()} and got[FP8_NAME].dtype == torch.bfloat16


def test_serve_command_starts_fp8_servers(monkeypatch, tmp_path):
    """`python -m hapo_megatron.rollout.sglang.serve --quantization fp8 --kv-cache-dtype fp8_e4m3`: the
    FP8 copy and both flags reach every server (mutation: the flags not passed to launch_server)."""
    from hapo_megatron.rollout.sglang import launch as sglang_launch, serve

    a = serve.parse_args(["--model-path", fp8_ready_model(tmp_path / "model"), "--log-dir", str(tmp_path / "logs"),
                          "--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3", "--device", "cuda"])
    launched = []

    def fake_launch(model_path, **kw):
        launched.append((model_path, kw))
        raise SystemExit(0)  # main would wait for the server next
    monkeypatch.setattr(sglang_launch, "launch_server", fake_launch)
    monkeypatch.setenv("HAPO_ROLLOUT_API_KEY", "k" * 32)
    with pytest.raises(SystemExit):
        serve.main(["--model-path", a.model_path, "--log-dir", a.log_dir, "--quantization", "fp8",
                    "--kv-cache-dtype", "fp8_e4m3", "--device", "cuda", "--host", "127.0.0.1"])
    ((path, kw),) = launched
    assert path == str(tmp_path / "logs" / "fp8_model")
    assert json.load(open(f"{path}/config.json"))["quantization_config"]["quant_method"] == "fp8"
    assert (kw["quantization"], kw["kv_cache_dtype"]) == ("fp8", "fp8_e4m3")
    with pytest.raises(ValueError, match="needs CUDA servers"):
        serve.serving_model_path(serve.parse_args(["--model-path", a.model_path, "--quantization", "fp8",
                                                   "--device", "cpu"]), "cpu")
    plain = serve.parse_args(["--model-path", a.model_path])
    assert serve.serving_model_path(plain, "cpu") == a.model_path


def test_node_servers_launch_fp8_and_both_engines_quantise(monkeypatch, tmp_path):
    """The trainer's own launch (node_servers.start_node_servers, one process): each node's
    servers start from that node's FP8 copy with the flags, and both engines (rank 0's and the
    node's tensor-sync one) quantise their syncs (mutations: quantization not passed to
    _launch_own / launch_server / the engines)."""
    from hapo_megatron.rollout.sglang import launch as sglang_launch, node_servers
    from hapo_megatron.rollout.sglang.client import SGLangHTTP

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    launched = []

    def fake_launch(model_path, **kw):
        launched.append((model_path, kw))
        return ServerHandle(url=f"http://127.0.0.1:{kw['port']}")
    monkeypatch.setattr(sglang_launch, "launch_server", fake_launch)
    monkeypatch.setattr(SGLangHTTP, "wait_healthy", lambda self, *a, **k: None)
    cfg = SGLangConfig(num_servers=1, colocate=True, weight_sync="tensor")
    eng = node_servers.start_node_servers(cfg, model_path=fp8_ready_model(tmp_path / "model"), device="cuda",
                                          log_dir=str(tmp_path / "logs"), api_key="k" * 32, quantization="fp8",
                                          kv_cache_dtype="fp8_e4m3")
    try:
        ((path, kw),) = launched
        assert path == str(tmp_path / "logs" / "node0" / "fp8_model")
        assert (kw["quantization"], kw["kv_cache_dtype"]) == ("fp8", "fp8_e4m3")
        assert eng.cluster.quantization == "fp8" and eng.node_sync.quantization == "fp8"
    finally:
        eng.shutdown()
