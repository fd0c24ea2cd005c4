"""`hapo doctor`'s MoE group: one check per GPU speed setting (grouped MLP, permute fusion, RoPE
fusion) against the unfused path and the EP=2 training check (2 GPUs); on a machine without CUDA
each reports SKIP, never PASS."""

import pytest
import torch

from hapo_megatron.doctor import build_parser, collect_checks, run_checks
from hapo_megatron.doctor.moe_checks import FUSED_PATHS, UNFUSED
from hapo_megatron.doctor.moe_ep_checks import NAME as EP_NAME


def test_each_fused_setting_has_a_check_against_the_unfused_path():
    assert {s for _, s in FUSED_PATHS} == set(UNFUSED)  # every setting the config turns on is checked
    checks = collect_checks(build_parser().parse_args(["--only", "moe"]))
    assert [name for _, name, _, _ in checks] == [name for name, _ in FUSED_PATHS] + [EP_NAME]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer; GPUs run the comparison")
def test_cpu_reports_skipped():
    results = run_checks(collect_checks(build_parser().parse_args(["--only", "moe"])), progress=False)
    assert [r.status for r in results] == ["SKIP"] * 4
    assert all("CUDA" in r.figure for r in results)


def _ep_body(rank, world, tmpdir):
    from hapo_megatron.doctor.moe_ep_checks import _rank_body
    return _rank_body(rank, tmpdir, packed_rows=False)


def test_ep2_body_runs_on_two_cpu_ranks(tmp_path):
    """The GPU check's rank body on two gloo ranks (bf16, local spec, no packed pass: the local
    spec's MoE attention takes no packed rows): the per-expert export is bit-exact at EP2, the step
    is not skipped and its MoE metrics are finite and the same on both ranks. Guards the doctor's
    code against API drift; the GPU comparison itself runs only on GPUs."""
    import math

    from tests.distributed import run_distributed
    r0, r1 = run_distributed(_ep_body, 2, str(tmp_path), timeout=600)
    assert r0["export_ok"] and r1["export_ok"] and r0["experts"] == 2
    assert r0["skipped"] == r1["skipped"] == 0
    assert r0["metrics"] == r1["metrics"] and "actor/moe_aux_loss" in r0["metrics"]
    assert all(math.isfinite(v) for v in r0["metrics"].values())
    assert r0["padded"] == r1["padded"] < 0  # summed over both ranks' response tokens


def _padded_body(rank, world):
    """`moe_checks._outputs` on CPU with the local spec (the GPU check's body without TE): every
    router call gets a padding mask with pads in it and routes every position to its top-k (what
    TE's fused permute needs: ``num_out_tokens == routing_map.sum()``)."""
    from hapo_megatron.doctor.moe_checks import _outputs
    from hapo_megatron.models import build_gpt_model
    from hapo_megatron.models.hf_config import tiny_hf_config
    from hapo_megatron.parallel.groups import destroy_parallel, initialize_parallel

    initialize_parallel(tp=1, seed=0)
    cfg = tiny_hf_config("qwen3_moe")
    model = build_gpt_model(cfg, use_te=False, sequence_parallel=False)
    calls = []

    def hook(router, inputs, output):
        pad = inputs[1] if len(inputs) > 1 else None
        calls.append((None if pad is None else int(pad.sum()), output[1].shape[0] * router.topk,
                      int(output[1].sum())))
    handles = [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__ == "TopKRouter"]
    padded, parts, grad = _outputs(model, cfg, device="cpu")
    for h in handles:
        h.remove()
    destroy_parallel()
    return calls, bool(torch.isfinite(padded).all()), len(parts), grad


def test_the_fused_checks_pass_padding_like_the_trainer():
    """Fails when `_outputs` leaves the padding mask out (tried: the routers then see no pad, as
    before; the fused permute's condition was never exercised with pads)."""
    from tests.distributed import run_distributed

    ((calls, finite, parts, grad),) = run_distributed(_padded_body, 1, timeout=300)
    assert calls and finite and parts == 3 and grad > 0
    assert all(pads is not None and pads > 0 for pads, _, _ in calls), calls  # padded and packed passes
    assert all(expected == routed for _, expected, routed in calls), calls
