"""Rank functions for the multi-rank conversion tests (module level so spawned ranks import them).

Each rank builds the same random HF model (same seed), converts it into its Megatron shard and
checks: logits vs the HF forward, export_hf_weights vs the HF state dict (bit-exact), and
dist_checkpointing save/load (resharded to another layout).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ARCHS = ("llama", "qwen2", "qwen3")
SEQ = 12
# Llama with Llama-3.1 RoPE scaling; the short original context makes every frequency band
# (kept, interpolated, divided) occur at head_dim 16.
ARCH_OVERRIDES = {"llama": dict(rope_theta=10000.0, rope_scaling={
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32})}


def random_hf_model(arch: str, seed: int = 0, **overrides):
    """A tiny HF model whose every tensor is random (norms around 1, biases non-zero)."""
    from transformers import AutoModelForCausalLM

    from hapo_megatron.models import tiny_hf_config

    cfg = tiny_hf_config(arch, **{**ARCH_OVERRIDES.get(arch, {}), **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.05 * noise)
    return cfg, model


def hf_state(cfg, model) -> dict:
    """HF state dict as saved on disk (the tied lm_head copy left out, MoE experts per expert)."""
    from hapo_megatron.convert import per_expert_state

    return per_expert_state({k: v for k, v in model.state_dict().items()
                             if not (cfg.tie_word_embeddings and k == "lm_head.weight")})


def input_ids(cfg, batch: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(123)
    return torch.randint(0, cfg.vocab_size, (batch, SEQ), generator=gen)


def mcore_logits(model, ids, groups) -> torch.Tensor | None:
    """Full-vocab logits `[b, s, V_pad]` on the last stage (None elsewhere); PP by plain send/recv."""
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    if groups.pp_size > 1:
        src = dist.get_global_rank(groups.pp, groups.pp_rank - 1) if not groups.is_pipeline_first else None
        if src is not None:
            hidden = torch.empty(ids.shape[1], ids.shape[0], model.config.hidden_size)
            dist.recv(hidden, src=src)
            model.set_input_tensor(hidden)
    with torch.no_grad():
        out = model(ids, pos, None)
    if not groups.is_pipeline_last:
        dist.send(out.contiguous(), dst=dist.get_global_rank(groups.pp, groups.pp_rank + 1))
        return None
    parts = [torch.empty_like(out) for _ in range(groups.tp_size)]
    dist.all_gather(parts, out.contiguous(), group=groups.tp)
    return torch.cat(parts, dim=-1)


def check_layout(tp: int, pp: int, tmpdir: str, save_arch: str | None = None) -> dict:
    """Load each arch at (tp, pp), compare logits and exported weights; optionally save a ckpt."""
    from hapo_megatron.convert import export_hf_weights, load_hf_weights_into_mcore, save_hf_checkpoint
    from hapo_megatron.convert import save_megatron_checkpoint
    from hapo_megatron.models import PADDED_VOCAB_LOGIT, build_gpt_model
    from hapo_megatron.parallel.groups import destroy_parallel, initialize_parallel

    g = initialize_parallel(tp=tp, pp=pp)
    result = {}
    for arch in ARCHS:
        cfg, hf = random_hf_model(arch)
        ref_state = hf_state(cfg, hf)
        model = build_gpt_model(cfg, use_te=None, sequence_parallel=False)
        source = ref_state
        if tp > 1 and arch == "qwen2":  # also exercise the lazy safetensors reader
            path = f"{tmpdir}/hf_{arch}"
            if dist.get_rank() == 0:
                save_hf_checkpoint(ref_state.items(), path, cfg, max_shard_bytes=20_000)
            dist.barrier()
            source = path
        load_hf_weights_into_mcore(model, source, cfg, tp_rank=g.tp_rank, tp_size=tp, pp_rank=g.pp_rank, pp_size=pp)
        ids = input_ids(cfg)
        logits = mcore_logits(model, ids, g)
        diff = None
        if logits is not None:
            with torch.no_grad():
                ref = hf(ids).logits
            assert torch.all(logits[..., cfg.vocab_size:] == PADDED_VOCAB_LOGIT)
            diff = (logits[..., : cfg.vocab_size] - ref).abs().max().item()
        chunks = [_ddp(model) if (tp, arch) == (2, "llama") else model]  # the trainer passes DDP chunks
        exported = list(export_hf_weights(chunks, cfg, tp_group=g.tp, pp_group=g.pp))
        names = [n for n, _ in exported]
        assert sorted(names) == sorted(ref_state), (sorted(set(names) ^ set(ref_state)))
        not_equal = [n for n, t in exported if not torch.equal(t, ref_state[n])]
        assert not not_equal, f"{arch} tp{tp} pp{pp}: exported tensors differ: {not_equal}"
        result[arch] = {"logit_diff": diff, "names": names}
        if (tp, arch) == (2, "qwen3"):  # bf16 params: loading casts, exporting gives the cast HF tensors
            model16 = build_gpt_model(cfg, dtype=torch.bfloat16, use_te=None, sequence_parallel=False)
            load_hf_weights_into_mcore(model16, ref_state, cfg, tp_rank=g.tp_rank, tp_size=tp)
            for name, t in export_hf_weights(model16, cfg, tp_group=g.tp, pp_group=g.pp):
                assert t.dtype == torch.bfloat16 and torch.equal(t, ref_state[name].bfloat16()), name
        if arch == save_arch:
            save_megatron_checkpoint([model], f"{tmpdir}/mcore_{arch}", hf_config=cfg, meta={"tp": tp, "pp": pp})
    destroy_parallel()
    return result


def _ddp(model):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)


def check_reload(tp: int, pp: int, tmpdir: str, arch: str) -> bool:
    """Load a torch_dist checkpoint (saved under another layout) and export it: equals HF."""
    from hapo_megatron.convert import export_hf_weights, load_megatron_checkpoint
    from hapo_megatron.models import build_gpt_model
    from hapo_megatron.parallel.groups import destroy_parallel, initialize_parallel

    g = initialize_parallel(tp=tp, pp=pp)
    cfg, hf = random_hf_model(arch)
    model = build_gpt_model(cfg, use_te=None, sequence_parallel=False)
    load_megatron_checkpoint([model], f"{tmpdir}/mcore_{arch}")
    ref_state = hf_state(cfg, hf)
    for name, tensor in export_hf_weights(model, cfg, tp_group=g.tp, pp_group=g.pp):
        assert torch.equal(tensor, ref_state[name]), name
    destroy_parallel()
    return True


def train_step(tp: int, pp: int) -> dict:
    """One optimizer step through the CPU shims: DDP + DistributedOptimizer + forward_backward_func
    (1F1B over gloo at PP2). Every rank sees the same data, so any layout gives the same numbers."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from hapo_megatron.convert import gather_hf_state_dict, load_hf_weights_into_mcore
    from hapo_megatron.models import build_gpt_model
    from hapo_megatron.parallel.groups import destroy_parallel, initialize_parallel

    g = initialize_parallel(tp=tp, pp=pp)
    cfg, hf = random_hf_model("qwen2")  # tied: PP2 needs the embedding-group gradient sync
    model = build_gpt_model(cfg, use_te=None, sequence_parallel=False)
    load_hf_weights_into_mcore(model, hf_state(cfg, hf), cfg, tp_rank=g.tp_rank, tp_size=tp)
    model.config.finalize_model_grads_func = finalize_model_grads
    ddp = _ddp(model)
    # adam_eps=1: Adam's first step is lr * g / (|g| + eps), about lr * g here; with a tiny eps it is
    # lr * sign(g), which would turn rounding noise in near-zero gradients into full steps.
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.5, adam_eps=1.0, weight_decay=0.0,
                                                 use_distributed_optimizer=True, clip_grad=0.0), [ddp])
    ids = input_ids(cfg, batch=4)
    pos = torch.arange(SEQ).unsqueeze(0)

    def step(it, m):
        x = next(it)
        out = m(x, pos, None, labels=x)  # [b, s] per-token losses on the last stage
        return out, lambda o: (o.sum() / o.numel(), {"loss": (o.sum() / o.numel()).detach()})

    ddp.zero_grad_buffer()
    opt.zero_grad()
    losses = get_forward_backward_func()(forward_step_func=step, data_iterator=iter(ids.split(1)), model=[ddp],
                                         num_microbatches=4, seq_length=SEQ, micro_batch_size=1)
    ok, grad_norm, _ = opt.step()
    exported = gather_hf_state_dict([ddp], cfg, tp_group=g.tp, pp_group=g.pp)
    destroy_parallel()
    return {"ok": ok, "grad_norm": grad_norm, "losses": [float(x["loss"]) for x in losses] if losses else None,
            "embed": exported["model.embed_tokens.weight"]}


def all_layouts(rank: int, world: int, tmpdir: str) -> dict:
    """TP1 (as DP2), TP2, PP2 (layer 0 | layer 1), and torch_dist checkpoints resharded TP2 <-> PP2."""
    out = {"tp1": check_layout(1, 1, tmpdir), "tp2": check_layout(2, 1, tmpdir, save_arch="qwen3"),
           "pp2": check_layout(1, 2, tmpdir, save_arch="qwen2")}
    out["reload qwen3 tp2 -> pp2"] = check_reload(1, 2, tmpdir, "qwen3")
    out["reload qwen2 pp2 -> tp2"] = check_reload(2, 1, tmpdir, "qwen2")
    out["train"] = {"tp1": train_step(1, 1), "tp2": train_step(2, 1), "pp2": train_step(1, 2)}
    return out
