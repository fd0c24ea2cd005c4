"""`hapo doctor`'s FP8 rollout check (doctor/fp8_checks.py): its figures by hand, its CPU skip,
and the whole check on a GPU."""

import importlib.util
import math

import pytest
import torch

from hapo_megatron.doctor import fp8_checks
from hapo_megatron.doctor.report import PASS, SKIP


def test_logprob_gap_by_hand():
    """diffs log pi - log mu = [0, ln 2]: mean |d| = ln2 / 2; k3 = mean(e^d - 1 - d) = (1 - ln 2) / 2."""
    gap = fp8_checks.logprob_gap([-1.0, -2.0], [-1.0, -2.0 + math.log(2)])
    assert gap["mean_abs"] == pytest.approx(math.log(2) / 2, rel=1e-12)
    assert gap["k3"] == pytest.approx((1 - math.log(2)) / 2, rel=1e-12)
    assert fp8_checks.logprob_gap([-0.5], [-0.5]) == {"mean_abs": 0.0, "k3": 0.0}
    with pytest.raises(ValueError, match="equally many"):
        fp8_checks.logprob_gap([-1.0], [])


def test_default_model_is_fp8_servable(tmp_path):
    from hapo_megatron.convert import HFCheckpointReader
    from hapo_megatron.rollout.fp8_weights import check_servable

    reader = HFCheckpointReader(fp8_checks.write_fp8_tiny_model(str(tmp_path / "m")))
    check_servable({n: reader.shape(n) for n in reader}, tp_size=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_skipped_on_cpu_with_the_reason():
    res = fp8_checks.check_fp8_rollouts()
    assert res.status == SKIP and ("needs CUDA" in res.figure or "not installed" in res.figure)


def test_listed_in_the_sglang_group():
    from hapo_megatron.doctor import build_parser, collect_checks

    names = [name for group, name, _, _ in collect_checks(build_parser().parse_args(["--only", "sglang"]))]
    assert fp8_checks.NAME in names


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None,
                    reason="needs CUDA and SGLang")
def test_fp8_check_passes_on_a_gpu():
    res = fp8_checks.check_fp8_rollouts()
    print(res.figure)
    assert res.status == PASS, res.figure
    assert "tok/s bf16" in res.figure and "k3 KL" in res.figure


def test_compare_on_cpu_with_transformers_as_the_server(tmp_path):
    """The figures of `_compare` when the "server" is transformers itself with the new weights:
    its greedy tokens are its own choice (share 0), its log-probs give a zero gap; against the old
    weights its tokens differ somewhere (the sync-arrived signal)."""
    from transformers import AutoModelForCausalLM

    from hapo_megatron.doctor.colocated_checks import _new_weights
    from hapo_megatron.rollout.engine import Sample

    model_dir = fp8_checks.write_fp8_tiny_model(str(tmp_path / "m"))
    old = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    new.load_state_dict(_new_weights(old))
    greedy, sampled = [], []
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for i, p in enumerate(fp8_checks.PROMPTS):
            ids = list(p)
            for _ in range(6):
                ids.append(int(new(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            greedy.append([Sample(prompt_ids=list(p), response_ids=ids[len(p):], rollout_logprobs=[0.0] * 6,
                                  temperatures=[], finish_reason="length", prompt_index=i, sample_index=0)])
            response = torch.randint(3, 80, (5,), generator=g).tolist()
            _, logps = fp8_checks._teacher_forced_logprobs(new, list(p), response)
            sampled.append([Sample(prompt_ids=list(p), response_ids=response, rollout_logprobs=logps.tolist(),
                                   temperatures=[], finish_reason="length", prompt_index=i, sample_index=0)])
    figures = fp8_checks._compare(greedy, sampled, old, new)
    assert figures["mismatch_share"] == 0.0
    assert figures["mean_abs"] == 0.0 and figures["k3"] == 0.0
    assert figures["moved"] > 0
