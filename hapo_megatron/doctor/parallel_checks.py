"""TP=2 and CP=2 on two ranks started here (NCCL on two GPUs when visible, gloo on CPU):
vocab-parallel log-prob + entropy and its gradient against the float64 full-vocab answer, and the
context-parallel split / all-gather of a sequence."""

from __future__ import annotations

import torch

from hapo_megatron.doctor import two_ranks
from hapo_megatron.doctor.report import FAIL, PASS, SKIP, CheckResult

TOLERANCE = 1e-4  # float32 on both sides


def _tp2(rank: int, device: str) -> float:
    from hapo_megatron.parallel.vocab_parallel import vocab_parallel_logprobs_entropy
    g = torch.Generator().manual_seed(1)
    full = torch.randn(64, 1000, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 1000, (64,), generator=g)
    shard = full[:, rank * 500:(rank + 1) * 500].float().to(device).requires_grad_()
    lp, ent = vocab_parallel_logprobs_entropy(shard, targets.to(device), tp_group=torch.distributed.group.WORLD,
                                              temperature=1.0)
    lp.sum().backward()
    ref = full.clone().requires_grad_()
    ref_lp = torch.log_softmax(ref, -1)
    ref_lp.gather(-1, targets.unsqueeze(-1)).sum().backward()
    ref_ent = -(ref_lp.exp() * ref_lp).sum(-1)
    ref_lp = ref_lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_grad = ref.grad[:, rank * 500:(rank + 1) * 500]
    return max(float((lp.detach().double().cpu() - ref_lp.detach()).abs().max()),
               float((ent.detach().double().cpu() - ref_ent.detach()).abs().max()),
               float((shard.grad.double().cpu() - ref_grad).abs().max()))


def _cp2(rank: int, device: str) -> float:
    from hapo_megatron.parallel.context_parallel import all_gather_from_cp, split_for_cp
    seq = torch.arange(2 * 24, dtype=torch.float32).reshape(2, 24).to(device)
    local = split_for_cp(seq, 2, rank)
    back = all_gather_from_cp(local, torch.distributed.group.WORLD)
    total = local.sum()
    torch.distributed.all_reduce(total)
    return max(float((back - seq).abs().max()), abs(float(total) - float(seq.sum())))


def _tp2_cp2(rank: int, device: str) -> dict:
    return {"TP=2": _tp2(rank, device), "CP=2": _cp2(rank, device)}


def run_two_ranks(timeout_s: float = 240.0) -> dict:
    """{"TP=2": err, "CP=2": err} (max over ranks) or {"error": message}."""
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    answers = two_ranks.run_two_ranks(_tp2_cp2, use_cuda=use_cuda, timeout_s=timeout_s)
    if "error" in answers:
        return answers
    out = {k: max(a[k] for a in answers.values()) for k in ("TP=2", "CP=2")}
    out["backend"] = "nccl, 2 GPUs" if use_cuda else "gloo, 2 CPU processes"
    return out


def parallel_checks() -> list:
    """(name, fn) pairs sharing one two-rank run."""
    state: dict = {}

    def result(key: str) -> CheckResult:
        import torch as _t
        if _t.cuda.is_available() and _t.cuda.device_count() < 2:
            return CheckResult(key, SKIP, f"{_t.cuda.device_count()} GPU visible: needs 2")
        if not state:
            state.update(run_two_ranks())
        if "error" in state:
            return CheckResult(key, FAIL, state["error"],
                               "two local ranks could not run a collective: check NCCL_* settings, NCCL_DEBUG=INFO "
                               "output and that the GPUs can talk (nvidia-smi topo -m)")
        err = state[key]
        fig = f"{state['backend']}: max |err| {err:.1e} vs single-process float64"
        if err > TOLERANCE:
            return CheckResult(key, FAIL, fig, "parallel results disagree with one process: run "
                               "python -m pytest tests/parallel -q and report the failure")
        return CheckResult(key, PASS, fig)
    return [("TP=2", lambda: result("TP=2")), ("CP=2", lambda: result("CP=2"))]
