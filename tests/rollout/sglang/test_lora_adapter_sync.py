"""SGLang's LoRA adapter mode (``rollout.sglang.lora_sync: adapter``, docs/lora.md).

On CPU: the ``/load_lora_adapter_from_tensors`` body (its fields are SGLang's request's, and SGLang's
own deserialiser and bucket reader give back every adapter tensor bit for bit), the engine's sync
(a new adapter name per sync, the previous one unloaded, every ``/generate`` naming the current
one), the launch flags and the refusals. Against a real server: GPU only (`test_adapter_mode_on_a_real_server`):
SGLang 0.5.23's CPU backend cannot serve LoRA, see `config.validate.CPU_LORA_REFUSED`.
"""

from __future__ import annotations

import pytest
import torch

from hapo_megatron.rollout.engine import SamplingParams
from hapo_megatron.rollout.sglang.weight_sync import lora_adapter_name, lora_adapter_payload
from tests.rollout.sglang.engines import sglang_engine
from tests.rollout.sglang.fake_sglang import FakeSession

URLS = ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4.0, "target_modules": ["q_proj", "down_proj"]}


def _adapters(seed=0):
    g = torch.Generator().manual_seed(seed)
    pre = "base_model.model.model.layers.0"
    return [(f"{pre}.mlp.down_proj.lora_A.weight", torch.randn(2, 16, generator=g)),
            (f"{pre}.mlp.down_proj.lora_B.weight", torch.randn(8, 2, generator=g)),
            (f"{pre}.self_attn.q_proj.lora_A.weight", torch.randn(2, 8, generator=g)),
            (f"{pre}.self_attn.q_proj.lora_B.weight", torch.randn(8, 2, generator=g))]


def _request_fields(cls_name: str) -> set[str]:
    """The fields of an SGLang request class, read from its source (importing ``io_struct`` in this
    process would need the CPU stand-ins, which only servers get)."""
    import ast
    import importlib.util
    import os
    spec = importlib.util.find_spec("sglang")
    path = os.path.join(os.path.dirname(spec.origin), "srt", "managers", "io_struct.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name]
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}


def test_payload_is_what_sglang_reads_back():
    pytest.importorskip("sglang")
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    tensors = _adapters()
    body, _ = lora_adapter_payload(tensors, CONFIG, lora_name="hapo-policy-3", num_ranks=2)
    fields = _request_fields("LoadLoRAAdapterFromTensorsReqInput")
    assert {"lora_name", "config_dict", "serialized_named_tensors", "load_format"} <= fields
    assert set(body) <= fields
    assert body["lora_name"] == "hapo-policy-3" and body["config_dict"] == CONFIG
    assert body["load_format"] == "flattened_bucket" and len(body["serialized_named_tensors"]) == 2
    for blob in body["serialized_named_tensors"]:  # what each server TP rank does (managers/tp_worker.py)
        data = MultiprocessingSerializer.deserialize(blob)
        got = dict(FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"],
                                         metadata=data["metadata"]).reconstruct_tensors())
        assert got.keys() == dict(tensors).keys()
        for name, t in tensors:
            assert torch.equal(got[name], t), name


def test_payload_refuses_what_is_not_an_adapter():
    with pytest.raises(ValueError, match="not peft LoRA names"):
        lora_adapter_payload([("model.layers.0.mlp.down_proj.weight", torch.zeros(2, 2))], CONFIG, lora_name="x")
    with pytest.raises(ValueError, match="no adapter tensors"):
        lora_adapter_payload([], CONFIG, lora_name="x")


def test_engine_loads_a_new_adapter_per_sync_unloads_the_previous_and_generates_with_it():
    pytest.importorskip("sglang")
    session = FakeSession()
    eng = sglang_engine(server_urls=URLS, colocate=False, weight_sync="disk", session=session, launch=False,
                        wait_for_servers=False, lora_adapter=CONFIG)
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=2)
    eng.generate([[5, 6]], params)
    assert "lora_path" not in session.posts("/generate")[-1][1]  # before the first sync: the base
    eng.update_weights(iter(_adapters(0)))
    loads = session.posts("/load_lora_adapter_from_tensors")
    assert [(u.rsplit("/", 1)[0], b["lora_name"]) for u, b in loads] == [(u, lora_adapter_name(1)) for u in URLS]
    assert session.posts("/unload_lora_adapter") == [] and session.posts("/update_weights_from_disk") == []
    eng.generate([[5, 6]], params)
    assert session.posts("/generate")[-1][1]["lora_path"] == lora_adapter_name(1)
    eng.update_weights(iter(_adapters(1)))
    assert [b["lora_name"] for _, b in session.posts("/load_lora_adapter_from_tensors")[2:]] == [
        lora_adapter_name(2)] * 2
    assert [b for _, b in session.posts("/unload_lora_adapter")] == [{"lora_name": lora_adapter_name(1)}] * 2
    eng.generate([[5, 6]], params)
    assert session.posts("/generate")[-1][1]["lora_path"] == lora_adapter_name(2)


def test_launch_flags_and_engine_config_follow_model_lora():
    from types import SimpleNamespace

    from hapo_megatron.config import load_config
    from hapo_megatron.training.build import engine_settings
    cfg = load_config(overrides=["rollout.engine=sglang", "model.lora.rank=8", "model.lora.target_modules=[linear_qkv]",
                                 "rollout.sglang.lora_sync=adapter"])
    hf = SimpleNamespace(model_type="llama", num_hidden_layers=2)
    rollout, _ = engine_settings(cfg, hf, on_gpu=True)
    extra = list(rollout.sglang.extra_server_args)
    i = extra.index("--enable-lora")
    assert extra[i:] == ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "k_proj",
                         "v_proj", "--max-loras-per-batch", "2"]
    merged = load_config(overrides=["rollout.engine=sglang", "model.lora.rank=8"])
    assert "--enable-lora" not in engine_settings(merged, hf, on_gpu=True)[0].sglang.extra_server_args


@pytest.mark.parametrize("overrides,field", [
    (["rollout.engine=sglang", "rollout.sglang.lora_sync=adapter"], "model.lora.rank > 0"),
    (["model.lora.rank=4", "rollout.sglang.lora_sync=adapter"], "rollout.engine=sglang"),
    (["rollout.engine=sglang", "model.lora.rank=4", "rollout.sglang.lora_sync=adapter", "rollout.max_staleness=1",
      "rollout.sglang.colocate=false"],
     "rollout.max_staleness > 0"),
    (["rollout.sglang.lora_sync=both"], "rollout.sglang.lora_sync")])
def test_adapter_mode_refusals_name_the_field(overrides, field):
    from hapo_megatron.config import load_config
    with pytest.raises(ValueError) as e:
        load_config(overrides=overrides)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_adapter_mode_on_cpu_servers_is_refused_with_the_reason():
    from hapo_megatron.config import load_config
    from hapo_megatron.config.validate import CPU_LORA_REFUSED, ModelSpec, validate_run
    from hapo_megatron.models import tiny_hf_config
    cfg = load_config(overrides=["rollout.engine=sglang", "model.lora.rank=4", "rollout.sglang.lora_sync=adapter"])
    with pytest.raises(ValueError, match="lora_sync='adapter' needs CUDA servers"):
        validate_run(cfg, ModelSpec.of(tiny_hf_config("llama")), 1, cuda=False)
    assert "pin" in CPU_LORA_REFUSED and "sglang/srt/lora/layers.py" in CPU_LORA_REFUSED


@pytest.mark.gpu
def test_adapter_mode_on_a_real_server(tmp_path):
    """A CUDA server with --enable-lora: after the engine's adapter sync, greedy tokens equal peft's
    (the base model + the same adapter) and differ from the base's; a second sync replaces it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: SGLang's CPU backend cannot serve LoRA (CPU_LORA_REFUSED)")
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    from hapo_megatron.rollout.sglang import launch as launcher
    from tests.rollout.sglang.real_sglang import hf_greedy, hf_model, start_server, tiny_model_dir
    model_dir = tiny_model_dir(str(tmp_path / "tiny"))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    base = hf_model(None, model_dir)
    h, d, f = base.config.hidden_size, base.config.hidden_size // base.config.num_attention_heads, \
        base.config.intermediate_size
    kv = base.config.num_key_value_heads * d
    sides = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h), "gate_proj": (h, f),
             "up_proj": (h, f), "down_proj": (f, h)}
    g = torch.Generator().manual_seed(0)
    adapters = {}
    for layer in range(base.config.num_hidden_layers):
        for t, (n_in, n_out) in sides.items():
            pre = f"base_model.model.model.layers.{layer}.{'mlp' if t in targets[4:] else 'self_attn'}.{t}"
            adapters[f"{pre}.lora_A.weight"] = torch.randn(4, n_in, generator=g) * 0.3
            adapters[f"{pre}.lora_B.weight"] = torch.randn(n_out, 4, generator=g) * 0.3
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": targets}
    server = start_server(model_dir, str(tmp_path / "server.log"), "key",
                          extra_args=tuple(launcher.lora_server_args(4, targets)))
    try:
        eng = sglang_engine(server_urls=[server], colocate=False, weight_sync="disk", launch=False,
                            api_key="key", lora_adapter=config, dtype=torch.float32)
        prompts = [[5, 9, 12, 7], [3, 4, 20]]
        greedy = SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=8, ignore_eos=True)
        before = [s[0].response_ids.tolist() for s in eng.generate(prompts, greedy)]
        eng.update_weights(iter(adapters.items()))
        after = [s[0].response_ids.tolist() for s in eng.generate(prompts, greedy)]
        peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8.0, target_modules=targets))
        set_peft_model_state_dict(peft_model, adapters)
        assert after == hf_greedy(peft_model.eval(), prompts, 8) and after != before
        eng.update_weights(iter({k: torch.zeros_like(v) for k, v in adapters.items()}.items()))  # B = 0: the base
        assert [s[0].response_ids.tolist() for s in eng.generate(prompts, greedy)] == before
    finally:
        launcher.stop_process(server)
