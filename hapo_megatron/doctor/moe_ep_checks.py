"""A tiny Qwen3-MoE trained at expert parallelism 2 on two GPUs (GPU only; docs/moe.md, "GPU
speed settings"): the actor as `hapo train` builds it (Transformer Engine spec with the fused MoE
paths, bf16, fused output layer, routing replay), on sequences of unequal lengths:

- the per-expert export (what the weight sync sends) gives transformers' on-disk names, and the
  loaded weights back bit-exact in bf16 (with TE's grouped MLP: `weight{j}` names);
- packed (THD) rows give the log-probs of padded rows (summed over every response token of both
  ranks; packing may give the ranks other sequences);
- routing replay with the experts transformers' own routers pick;
- one training step with its MoE metrics, finite and equal on both ranks.

Not covered here: SGLang returning routed experts and a live server sync (the "SGLang" group).
"""

from __future__ import annotations

import math
import os
import tempfile

import torch

from hapo_megatron.doctor import two_ranks
from hapo_megatron.doctor.report import FAIL, PASS, SKIP, CheckResult

NAME = "MoE EP=2 (2 GPUs)"
LOGPROB_TOL = 2e-2  # relative, on the sum of ~100 bf16 log-probs of magnitude ~5 (packed vs padded kernels)
ROW_TOKENS = 64  # the packed rows' real-token budget (two sequences per rank fit in one row)
LENGTHS = [(5, 23), (9, 4), (3, 17), (12, 9)]  # (prompt, response): unequal on purpose
FIX = ("the MoE actor at EP=2 fails on this machine: run python -m pytest tests/parallel/test_moe_training.py "
       "tests/parallel/test_routing_replay.py -q (the CPU equivalents) and report the versions (hapo doctor)")


def _sequences(hf_model):
    """The batch, with transformers' own top-k experts of every position as the engine's routes."""
    from hapo_megatron.training.batches.micro_batches import SequenceData
    cfg = hf_model.config
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, (p, r) in enumerate(LENGTHS):
        prompt = torch.randint(4, cfg.vocab_size, (p,), generator=gen).tolist()
        response = torch.randint(4, cfg.vocab_size, (r,), generator=gen).tolist()
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = hf_model(ids, output_router_logits=True).router_logits
        k = cfg.num_experts_per_tok
        # [positions, layers, k]: every layer of the tiny Qwen3-MoE is sparse
        routes = torch.stack([torch.topk(lg, k, dim=-1).indices for lg in logits], 1)
        out.append(SequenceData(prompt, response, advantage=1.0, routed_experts=routes[:-1].tolist(), index=i))
    return out


def _rank_body(rank: int, tmpdir: str, packed_rows: bool = True) -> dict:
    """One rank's part; ``packed_rows=False`` leaves the packed pass out (its "packed" figure is
    then the padded one: CPU runs, whose local-spec MoE attention has no packed path)."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from hapo_megatron.config import OptimConfig
    from hapo_megatron.convert import per_expert_state
    from hapo_megatron.models.hf_config import tiny_hf_config
    from hapo_megatron.parallel.groups import initialize_parallel
    from hapo_megatron.training.actor import MegatronActor
    from hapo_megatron.training.batches.micro_batches import build_rank_micro_batches, plan_micro_batches
    from hapo_megatron.training.sft import cross_entropy_loss_factory

    g = initialize_parallel(tp=1, ep=2, seed=0)
    path = os.path.join(tmpdir, "tiny_moe")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_hf_config("qwen3_moe")).eval()
    if rank == 0:
        hf.save_pretrained(path)
    dist.barrier()
    seqs = _sequences(hf)
    for pack in (False, True):  # every EP rank must run as many micro-batches (else the dispatch waits forever)
        counts = {len(p) for p in plan_micro_batches([s.num_tokens for s in seqs], dp_size=g.dp_size, pack=pack,
                                                     micro_batch_size=1,
                                                     max_tokens_per_micro_batch=ROW_TOKENS if pack else None)}
        if len(counts) != 1:
            raise RuntimeError(f"the plan gives the EP ranks {sorted(counts)} micro-batches (pack={pack})")
    actor = MegatronActor(AutoConfig.from_pretrained(path), groups=g, total_optimizer_steps=2, dtype="bf16",
                          init_hf_path=path, fused_output_layer=True, routing="replay", use_te=None,
                          sequence_parallel=False, recompute_activations=False, use_distributed_optimizer=True,
                          moe_aux_loss_coef=None,
                          optim=OptimConfig(lr=1e-3, lr_warmup_steps=0, weight_decay=0.0))
    reference = {n: t.to(torch.bfloat16) for n, t in per_expert_state(hf.state_dict()).items()
                 if not (n == "lm_head.weight" and hf.config.tie_word_embeddings)}  # the export omits it too
    exported = dict(actor.export_hf_weights(dtype=torch.bfloat16))
    export_ok = sorted(exported) == sorted(reference) and all(
        torch.equal(exported[n].cpu(), reference[n]) for n in reference)
    padded = build_rank_micro_batches(seqs, dp_rank=g.dp_rank, dp_size=g.dp_size, micro_batch_size=1,
                                      max_tokens_per_micro_batch=None)
    packed = build_rank_micro_batches(seqs, dp_rank=g.dp_rank, dp_size=g.dp_size, pack=True, micro_batch_size=1,
                                      max_tokens_per_micro_batch=ROW_TOKENS, seq_multiple=8, row_multiple=8)
    sums = torch.tensor([sum(float(lp.double().sum()) for lp, _ in actor.compute_logprobs_entropy(mbs, temperature=1.0))
                         for mbs in (padded, packed if packed_rows else padded)], dtype=torch.float64,
                        device=actor.device)
    dist.all_reduce(sums, group=g.dp)
    result = actor.train_step(padded, cross_entropy_loss_factory(g.tp))
    metrics = actor.moe_step_metrics()
    return {"export_ok": export_ok, "experts": g.ep_size, "padded": float(sums[0]), "packed": float(sums[1]),
            "skipped": actor.num_skipped, "metrics": metrics, "step": type(result).__name__}


def _gpu_rank(rank: int, device: str, tmpdir: str) -> dict:
    return _rank_body(rank, tmpdir)


def _run_two_ranks(timeout_s: float = 600.0) -> dict:
    with tempfile.TemporaryDirectory() as tmpdir:
        return two_ranks.run_two_ranks(_gpu_rank, tmpdir, use_cuda=True, timeout_s=timeout_s,
                                       on_timeout=" (a rank may wait in an expert dispatch)")


def check_moe_ep2() -> CheckResult:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return CheckResult(NAME, SKIP, "needs 2 CUDA GPUs (the CPU equivalents: tests/parallel/test_moe_*.py)")
    from hapo_megatron.models.gpt import te_available
    if not te_available():
        return CheckResult(NAME, SKIP, "needs Transformer Engine")
    out = _run_two_ranks()
    if "error" in out:
        return CheckResult(NAME, FAIL, out["error"], FIX)
    r0, r1 = out[0], out[1]
    rel = abs(r0["packed"] - r0["padded"]) / max(abs(r0["padded"]), 1e-12)
    finite = all(math.isfinite(v) for r in (r0, r1) for v in r["metrics"].values())
    fig = (f"export {'bit-exact' if r0['export_ok'] and r1['export_ok'] else 'DIFFERS'}; packed vs padded "
           f"log-prob sum rel diff {rel:.1e}; step metrics {sorted(r0['metrics'])} "
           f"aux {r0['metrics'].get('actor/moe_aux_loss', float('nan')):.3g}")
    problems = []
    if not (r0["export_ok"] and r1["export_ok"]):
        problems.append("the per-expert export differs from the loaded weights")
    if rel > LOGPROB_TOL:
        problems.append("packed rows disagree with padded rows")
    if not finite or r0["metrics"] != r1["metrics"] or "actor/moe_aux_loss" not in r0["metrics"]:
        problems.append("the MoE metrics are missing, not finite or differ between ranks")
    if r0["skipped"] or r1["skipped"]:
        problems.append("the training step was skipped (non-finite loss or gradient)")
    if problems:
        return CheckResult(NAME, FAIL, fig + " | " + "; ".join(problems), FIX)
    return CheckResult(NAME, PASS, fig)
