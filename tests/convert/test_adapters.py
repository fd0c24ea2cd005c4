"""Pure state-dict adapters and safetensors IO (single process, no Megatron model)."""

import os

import pytest
import torch

from hapo_megatron.convert import (
    HFCheckpointReader,
    get_adapter,
    hf_to_mcore,
    load_hf_state_dict,
    mcore_to_hf,
    save_hf_checkpoint,
)
from hapo_megatron.convert.model_io import chunk_entries
from tests.convert.dist_checks import ARCHS, hf_state, random_hf_model

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.fixture(scope="module")
def models():
    return {arch: random_hf_model(arch, num_hidden_layers=4) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_bit_exact_for_every_layout(models, arch):
    cfg, model = models[arch]
    ref = hf_state(cfg, model)
    for tp, pp in LAYOUTS:
        shards = {(t, p): hf_to_mcore(ref, cfg, t, tp, p, pp) for t in range(tp) for p in range(pp)}
        back = mcore_to_hf(shards, cfg)
        assert set(back) == set(ref), (tp, pp, set(back) ^ set(ref))
        bad = [n for n in ref if not (back[n].dtype == ref[n].dtype and torch.equal(back[n], ref[n]))]
        assert not bad, (tp, pp, bad)
    nested = [[hf_to_mcore(ref, cfg, t, 2, p, 2) for t in range(2)] for p in range(2)]
    assert all(torch.equal(v, ref[k]) for k, v in mcore_to_hf(nested, cfg).items())
    # the export order is deterministic and follows HF's layer order
    assert list(mcore_to_hf(hf_to_mcore(ref, cfg, 0, 1, 0, 1), cfg)) == list(get_adapter(cfg).hf_shapes())


def _reference_qkv(q, k, v, heads, groups, d):
    """Megatron's fused QKV rows written out: per query group, its q heads, its k head, its v head."""
    rows, per = [], heads // groups
    for g in range(groups):
        for h in range(g * per, (g + 1) * per):
            rows.append(q[h * d:(h + 1) * d])
        rows.append(k[g * d:(g + 1) * d])
        rows.append(v[g * d:(g + 1) * d])
    return torch.cat(rows)


@pytest.mark.parametrize("arch", ARCHS)
def test_layouts_against_loop_references(models, arch):
    cfg, model = models[arch]
    ref = hf_state(cfg, model)
    heads, groups, d = cfg.num_attention_heads, cfg.num_key_value_heads, get_adapter(cfg).head_dim
    attn, mlp = "model.layers.2.self_attn.", "model.layers.2.mlp."
    full_qkv = _reference_qkv(*(ref[attn + f"{p}_proj.weight"] for p in "qkv"), heads, groups, d)
    F, tp = cfg.intermediate_size, 2
    for t in range(tp):
        shard = hf_to_mcore(ref, cfg, t, tp, 1, 2)  # stage 1 of 2 holds layers 2, 3 as local 0, 1
        qkv = shard["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert torch.equal(qkv, full_qkv.chunk(tp)[t])
        if cfg.model_type == "qwen2":
            full_bias = _reference_qkv(*(ref[attn + f"{p}_proj.bias"] for p in "qkv"), heads, groups, d)
            assert torch.equal(shard["decoder.layers.0.self_attention.linear_qkv.bias"], full_bias.chunk(tp)[t])
        rows = slice(t * F // tp, (t + 1) * F // tp)
        fc1 = torch.cat([ref[mlp + "gate_proj.weight"][rows], ref[mlp + "up_proj.weight"][rows]])
        assert torch.equal(shard["decoder.layers.0.mlp.linear_fc1.weight"], fc1)
        cols = slice(t * F // tp, (t + 1) * F // tp)
        assert torch.equal(shard["decoder.layers.0.mlp.linear_fc2.weight"], ref[mlp + "down_proj.weight"][:, cols])
        if cfg.model_type == "qwen3":
            assert torch.equal(shard["decoder.layers.1.self_attention.q_layernorm.weight"],
                               ref["model.layers.3.self_attn.q_norm.weight"])


def test_vocab_padding_and_tied_embeddings(models):
    cfg, model = models["qwen2"]  # tied, vocab 160 -> padded 256
    ref = hf_state(cfg, model)
    first, last = hf_to_mcore(ref, cfg, 1, 2, 0, 2), hf_to_mcore(ref, cfg, 1, 2, 1, 2)
    emb = first["embedding.word_embeddings.weight"]
    assert emb.shape == (128, 64)  # rows 128..255 of the padded table
    assert torch.equal(emb[:32], ref["model.embed_tokens.weight"][128:]) and not emb[32:].any()
    assert "output_layer.weight" not in first and torch.equal(last["output_layer.weight"], emb)
    assert "output_layer.weight" not in hf_to_mcore(ref, cfg, 0, 1, 0, 1)  # PP1: one shared tensor
    cfg_l, model_l = models["llama"]
    assert "lm_head.weight" in mcore_to_hf(hf_to_mcore(hf_state(cfg_l, model_l), cfg_l, 0, 1, 0, 1), cfg_l)


def test_bad_inputs_are_listed(models):
    cfg, model = models["llama"]
    ref = dict(hf_state(cfg, model))
    del ref["model.layers.1.mlp.up_proj.weight"]
    ref["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 64)
    ref["model.layers.9.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError) as err:
        hf_to_mcore(ref, cfg, 0, 1, 0, 1)
    msg = str(err.value)
    for part in ("missing tensors (1)", "model.layers.1.mlp.up_proj.weight", "unexpected tensors (1)",
                 "model.layers.9.extra.weight", "wrong shapes (1)",
                 "q_proj.weight: checkpoint (3, 64) vs config (64, 64)"):
        assert part in msg, msg
    good = hf_state(cfg, model)
    with pytest.raises(ValueError, match="tp_size=4 must divide the model's num_key_value_heads=2"):
        hf_to_mcore(good, cfg, 0, 4, 0, 1)
    with pytest.raises(ValueError, match="pp_size=3"):
        hf_to_mcore(good, cfg, 0, 1, 0, 3)
    with pytest.raises(ValueError, match="missing"):
        mcore_to_hf({(1, 0): hf_to_mcore(good, cfg, 1, 2, 0, 1)}, cfg)  # TP rank 0 absent
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="unsupported architecture"):
        get_adapter(GPT2Config())


def test_safetensors_sharded_save_and_load(models, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg, model = models["qwen3"]
    ref = hf_state(cfg, model)
    out = str(tmp_path / "hf")
    index = save_hf_checkpoint(ref.items(), out, cfg, max_shard_bytes=60_000)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == set(ref) and os.path.isfile(os.path.join(out, "config.json"))
    loaded = load_hf_state_dict(out)
    assert all(torch.equal(loaded[n], ref[n]) for n in ref) and set(loaded) == set(ref)
    assert HFCheckpointReader(out).shape("model.embed_tokens.weight") == (160, 64)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    with pytest.raises(FileExistsError, match="--overwrite"):
        save_hf_checkpoint(ref.items(), out, cfg)
    save_hf_checkpoint(list(ref.items())[:3], out, cfg, overwrite=True)
    assert len(load_hf_state_dict(out)) == 3


class _Layer(torch.nn.Module):
    def __init__(self, number, names):
        super().__init__()
        self.layer_number = number
        for name in names:  # nested names as plain parameters on submodules
            mod = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros(1)))


def test_transformer_engine_names_are_resolved():
    from hapo_megatron.models import tiny_hf_config

    cfg = tiny_hf_config("llama", num_hidden_layers=2)
    te_layer = ["self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
                "self_attention.linear_proj.weight", "mlp.linear_fc1.layer_norm_weight",
                "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    chunk = torch.nn.Module()
    chunk.pre_process, chunk.post_process = False, True
    chunk.decoder = _Layer(0, ["final_layernorm.weight"])
    chunk.decoder.layers = torch.nn.ModuleList([_Layer(2, te_layer)])  # the second layer (PP2 stage 1)
    chunk.output_layer = _Layer(0, ["weight"])
    entries = chunk_entries(get_adapter(cfg), chunk)
    by_hf = {pm.hf[0]: pm for pm, _ in entries}
    assert by_hf["model.layers.1.input_layernorm.weight"].mcore == "decoder.layers.0.input_layernorm.weight"
    assert len(entries) == 8  # 6 layer tensors + final norm + output layer
    chunk.decoder.layers[0].register_parameter("surprise", torch.nn.Parameter(torch.zeros(1)))
    with pytest.raises(ValueError, match="surprise"):
        chunk_entries(get_adapter(cfg), chunk)
