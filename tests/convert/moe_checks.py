"""Rank functions for the multi-rank Qwen3-MoE conversion tests (module level: spawned ranks import
them). Every layout loads the same random HF model, compares logits with transformers'
Qwen3MoeForCausalLM and the exported weights with the HF state dict (bit-exact); torch_dist
checkpoints saved under one expert layout are loaded under another."""

from __future__ import annotations

import torch

from tests.convert.dist_checks import hf_state, input_ids, mcore_logits, random_hf_model

ARCH = "qwen3_moe"
# (tp, ep, etp, pp) on 2 ranks: EP alone, TP x EP (experts whole on each TP rank), ETP alone
# (the experts' FFN split like TP; CPU: allgather dispatcher), EP with data-parallel dense weights.
LAYOUTS = {"ep2": (1, 2, 1, 1), "tp2_ep2": (2, 2, 1, 1), "tp2_etp2": (2, 1, 2, 1), "pp2": (1, 1, 1, 2)}


def moe_model(seed: int = 0):
    """The tiny Qwen3-MoE with random weights; layer 1 is dense (mlp_only_layers) so both kinds of
    layer occur (and, at PP2, a stage without experts)."""
    return random_hf_model(ARCH, seed, num_hidden_layers=2, mlp_only_layers=[1])


def own_top_k(model, ids) -> torch.Tensor:
    """transformers' own router top-k ``[n, L, k]`` of every position of ``ids`` (0 in dense layers),
    from one full forward pass of ``model``."""
    cfg = model.config
    with torch.no_grad():
        logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
    out = torch.zeros(len(ids), cfg.num_hidden_layers, cfg.num_experts_per_tok, dtype=torch.long)
    sparse = [i for i in range(cfg.num_hidden_layers) if i not in (cfg.mlp_only_layers or [])]
    for layer, lg in zip(sparse, logits, strict=True):
        out[:, layer] = torch.topk(lg, cfg.num_experts_per_tok, dim=-1).indices
    return out


def check_layout(name: str, tmpdir: str, save: bool = False) -> dict:
    from hapo_megatron.convert import export_hf_weights, load_hf_weights_into_mcore, save_megatron_checkpoint
    from hapo_megatron.models import PADDED_VOCAB_LOGIT, build_gpt_model
    from hapo_megatron.parallel.groups import destroy_parallel, initialize_parallel

    tp, ep, etp, pp = LAYOUTS[name]
    g = initialize_parallel(tp=tp, pp=pp, ep=ep, etp=etp)
    cfg, hf = moe_model()
    ref = hf_state(cfg, hf)
    model = build_gpt_model(cfg, use_te=None, sequence_parallel=False).eval()
    load_hf_weights_into_mcore(model, ref, cfg, tp_rank=g.tp_rank, tp_size=g.tp_size, etp_rank=g.etp_rank,
                               etp_size=g.etp_size)
    ids = input_ids(cfg)
    logits = mcore_logits(model, ids, g)
    diff = None
    if logits is not None:
        with torch.no_grad():
            expected = hf(ids).logits
        assert torch.all(logits[..., cfg.vocab_size:] == PADDED_VOCAB_LOGIT)
        diff = (logits[..., : cfg.vocab_size] - expected).abs().max().item()
    groups = dict(tp_group=g.tp, pp_group=g.pp, ep_group=g.ep, etp_group=g.etp)
    exported = list(export_hf_weights(model, cfg, **groups))
    names = [n for n, _ in exported]
    assert sorted(names) == sorted(ref), sorted(set(names) ^ set(ref))
    not_equal = [n for n, t in exported if not torch.equal(t, ref[n])]
    assert not not_equal, f"{name}: exported tensors differ: {not_equal}"
    refused = None
    if ep > 1 or etp > 1:  # leaving out the expert groups is refused, not exported wrong
        try:
            list(export_hf_weights(model, cfg, tp_group=g.tp, pp_group=g.pp))
        except ValueError as err:
            refused = str(err)
    if save:
        save_megatron_checkpoint([model], f"{tmpdir}/mcore_{name}", hf_config=cfg, meta={"layout": name})
    destroy_parallel()
    return {"logit_diff": diff, "names": names, "refused": refused}


def check_reload(name: str, saved: str, tmpdir: str) -> bool:
    """Load the torch_dist checkpoint saved under layout `saved` at layout `name`; export equals HF."""
    from hapo_megatron.convert import export_hf_weights, load_megatron_checkpoint
    from hapo_megatron.models import build_gpt_model
    from hapo_megatron.parallel.groups import destroy_parallel, initialize_parallel

    tp, ep, etp, pp = LAYOUTS[name]
    g = initialize_parallel(tp=tp, pp=pp, ep=ep, etp=etp)
    cfg, hf = moe_model()
    model = build_gpt_model(cfg, use_te=None, sequence_parallel=False)
    load_megatron_checkpoint([model], f"{tmpdir}/mcore_{saved}")
    ref = hf_state(cfg, hf)
    for tensor_name, tensor in export_hf_weights(model, cfg, tp_group=g.tp, pp_group=g.pp, ep_group=g.ep,
                                                 etp_group=g.etp):
        assert torch.equal(tensor, ref[tensor_name]), tensor_name
    destroy_parallel()
    return True


def all_layouts(rank: int, world: int, tmpdir: str) -> dict:
    out = {name: check_layout(name, tmpdir, save=name in ("tp2_ep2", "tp2_etp2")) for name in LAYOUTS}
    out["reload tp2_ep2 -> ep2"] = check_reload("ep2", "tp2_ep2", tmpdir)
    out["reload tp2_etp2 -> pp2"] = check_reload("pp2", "tp2_etp2", tmpdir)
    return out
