"""The converter with Transformer Engine's grouped MLP (TEGroupedMLP, `moe_grouped_gemm` on GPU),
checked on CPU by constructing its parameter names: megatron-core 0.16.1's TEGroupedMLP holds one
GroupedLinear per projection (`mlp.experts.linear_fc1` / `linear_fc2`) whose parameter
`weight{j}` is local expert j's weight, where SequentialMLP has
`mlp.experts.local_experts.{j}.linear_fc1.weight`. A module tree with the grouped names (and the
shapes of the real shards) is loaded from HF tensors and exported back, bit-exact.
"""

import pytest
import torch

from hapo_megatron.convert import gather_hf_state_dict, hf_to_mcore, load_hf_weights_into_mcore
from hapo_megatron.convert.base import grouped_expert_name, sequential_expert_name
from hapo_megatron.convert.model_io import chunk_entries, local_experts
from hapo_megatron.convert.adapters import get_adapter
from tests.convert.dist_checks import hf_state
from tests.convert.moe_checks import moe_model


def test_grouped_and_sequential_names_map_both_ways():
    seq = "decoder.layers.3.mlp.experts.local_experts.12.linear_fc1.weight"
    grouped = "decoder.layers.3.mlp.experts.linear_fc1.weight12"
    assert grouped_expert_name(seq) == grouped and sequential_expert_name(grouped) == seq
    seq2 = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"
    assert sequential_expert_name(grouped_expert_name(seq2)) == seq2
    for other in ("decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.router.weight",
                  "decoder.layers.0.self_attention.linear_qkv.weight"):
        assert grouped_expert_name(other) is None and sequential_expert_name(other) is None


def _grouped_chunk(shards: dict, cfg, experts):
    """A GPTModel stand-in whose MoE layers name their experts as TEGroupedMLP does (zeros of the
    real shards' shapes), with the attributes the converter reads (layer_number,
    local_expert_indices, pre/post_process)."""
    root = torch.nn.Module()
    root.pre_process, root.post_process = True, True
    root.decoder = torch.nn.Module()
    root.decoder.layers = torch.nn.ModuleList()
    for i in range(cfg.num_hidden_layers):
        layer = torch.nn.Module()
        layer.layer_number = i + 1
        root.decoder.layers.append(layer)
    for name, t in shards.items():
        name = grouped_expert_name(name) or name
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(t), requires_grad=False))
    for i, sparse in enumerate(get_adapter(cfg).sparse):
        if sparse:
            root.decoder.layers[i].mlp.local_expert_indices = list(experts)
    return root


@pytest.mark.parametrize("ep_size,ep_rank", [(1, 0), (2, 0), (2, 1)])
def test_grouped_expert_model_loads_and_exports_hf_weights(ep_size, ep_rank):
    """HF -> grouped model -> HF is bit-exact, and weight{j} holds global expert experts[j]
    (cat(gate, up) in fc1, down in fc2) at EP rank ``ep_rank`` of ``ep_size``; at EP1 through the
    streaming export itself. Fails without the grouped lookup in `chunk_entries` (tried:
    ValueError "model has no parameter ...local_experts.0...")."""
    cfg, hf = moe_model()
    ref = hf_state(cfg, hf)
    adapter = get_adapter(cfg)
    per = cfg.num_experts // ep_size
    experts = list(range(ep_rank * per, (ep_rank + 1) * per))
    shards = hf_to_mcore(ref, cfg, 0, 1, 0, 1, ep_rank=ep_rank, ep_size=ep_size, etp_rank=0, etp_size=1)
    chunk = _grouped_chunk(shards, cfg, experts)
    params = dict(chunk.named_parameters())
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight0" in params
    assert not any("local_experts" in n for n in params)
    bound = {pm.mcore: p for pm, p in chunk_entries(adapter, chunk)}
    assert bound["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"] is \
        params["decoder.layers.0.mlp.experts.linear_fc2.weight1"]
    assert local_experts(chunk) == experts

    load_hf_weights_into_mcore(chunk, ref, cfg, tp_rank=0, tp_size=1)
    for j, e in enumerate(experts):
        hfe = f"model.layers.0.mlp.experts.{e}."
        fc1 = torch.cat([ref[hfe + "gate_proj.weight"], ref[hfe + "up_proj.weight"]])
        assert torch.equal(params[f"decoder.layers.0.mlp.experts.linear_fc1.weight{j}"], fc1)
        assert torch.equal(params[f"decoder.layers.0.mlp.experts.linear_fc2.weight{j}"], ref[hfe + "down_proj.weight"])
    if ep_size == 1:  # the streaming export (single process: every expert is here)
        back = gather_hf_state_dict(chunk, cfg)
        assert sorted(back) == sorted(ref) and all(torch.equal(back[n], ref[n]) for n in ref)
        return
    # this EP rank's share, tensor by tensor (the export's per-rank step; the EP broadcast is
    # tests/convert/test_convert_moe.py's)
    exported = {name: t for pm, p in chunk_entries(adapter, chunk)
                for name, t in zip(pm.hf, adapter.to_hf(pm, [p.detach()]))}
    assert all(torch.equal(t, ref[name]) for name, t in exported.items())
    mine = tuple(f"model.layers.0.mlp.experts.{e}." for e in experts)
    assert {n for n in exported if ".experts." in n} == {n for n in ref if n.startswith(mine)}
