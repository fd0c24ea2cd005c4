"""The Triton kernels of the fused log-prob + entropy (parallel/vocab_kernels.py) against the same
float64 reference and cases as the torch path (tests/parallel/test_vocab_parallel.py): on CPU
under Triton's interpreter, on a GPU compiled.

Triton reads `TRITON_INTERPRET` when it is imported (Megatron-Core imports it), so the
interpreted checks run in one child process started with it set; each check reports there and
is one test here. The interpreter casts float32 to bf16 by truncation (triton/runtime/
interpreter.py, `cast_impl`) where compiled kernels round to nearest: its bf16 gradients are
held to 2 units of 2^-8 instead of 1. The chunk size does not reach the kernels: one per case.
Blocks of 16 (8 per TP shard) columns split the 48-logit rows so that the online max's
rescaling between blocks runs (most rows have their max in a later block)."""

import os
import subprocess
import sys
import traceback

import pytest
import torch

from hapo_megatron.parallel.vocab_parallel import use_triton_kernels, vocab_parallel_logprobs_entropy
from tests.distributed import run_distributed
from tests.parallel.test_vocab_parallel import V, _check, _run_cases

pytest.importorskip("triton")
INTERPRETER_BF16_UNITS = 2.0
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _small_blocks(block: int) -> None:
    from hapo_megatron.parallel import vocab_kernels
    vocab_kernels.BLOCK_V = block


def _all_cases() -> None:
    _small_blocks(16)
    assert use_triton_kernels(torch.zeros(1))  # the path under test is the kernels'
    _check(_run_cases(None, 0, 1, chunks=(None,)), bf16_grad_units=INTERPRETER_BF16_UNITS)


def _equal_to_the_torch_path() -> None:
    """fp32 logits, several blocks, a temperature per row, rows masked at either end: the
    one-pass sums and the chunked ones agree to float32 rounding, the gradients too."""
    _small_blocks(16)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 100, generator=g) * 5
    logits[2, 40:] = float("-inf")  # the later blocks of a row all masked
    logits[4, :70] = float("-inf")  # the first blocks all masked: the max starts at -inf
    targets = torch.randint(0, 40, (9,), generator=g)
    targets[4] = 80
    temp = torch.rand(9, generator=g) + 0.5
    out = {}
    for mode in ("kernels", "torch"):
        os.environ["TRITON_INTERPRET"] = "1" if mode == "kernels" else "0"  # the dispatch's switch
        x = logits.clone().requires_grad_(True)
        lp, ent = vocab_parallel_logprobs_entropy(x, targets, temperature=temp, chunk_size=4, entropy_grad=True)
        (lp.sum() + 0.5 * ent.sum()).backward()
        out[mode] = (lp.detach(), ent.detach(), x.grad)
    os.environ["TRITON_INTERPRET"] = "1"
    for a, b in zip(out["kernels"], out["torch"]):
        assert torch.isfinite(a).all() and torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()


def _tp_worker(rank, world_size):
    import torch.distributed as dist

    _small_blocks(8)
    assert use_triton_kernels(torch.zeros(1))
    errs = _run_cases(dist.group.WORLD, rank, world_size, chunks=(None,))
    empty = torch.zeros(0, V // world_size, requires_grad=True)  # a rank with no rows
    lp, _ = vocab_parallel_logprobs_entropy(empty, torch.zeros(0, dtype=torch.long),
                                            tp_group=dist.group.WORLD, temperature=1.0)
    lp.sum().backward()
    return errs


def _tensor_parallel() -> None:
    """Two shards: each rank's sums are relative to its own max and moved onto the global one
    before the TP sum (in the masked row, one shard is all -inf)."""
    for errs in run_distributed(_tp_worker, 2, timeout=240):
        _check(errs, bf16_grad_units=INTERPRETER_BF16_UNITS)


def _linear_single() -> None:
    """The fused output layer (parallel/linear.py) on the kernels, slice by slice, against the
    logits path and float64: its own test's cases (padding, temperatures, logits in the thousands)
    with one slice (3 blocks) and with 5 slices (the merge between slices)."""
    from tests.parallel import test_linear_logprobs_entropy as linear
    _small_blocks(16)
    linear._run(None, 0, 1, chunks=(None, 5))


def _linear_tensor_parallel() -> None:
    assert all(run_distributed(_linear_tp_worker, 2, timeout=300))


def _linear_tp_worker(rank, world_size):
    """With and without sequence parallelism; one slice per shard (the slices' merge: above)."""
    from tests.parallel import test_linear_logprobs_entropy as linear
    _small_blocks(8)
    return linear._tp_worker(rank, world_size, chunks=(None,))


CHECKS = {"all cases": _all_cases, "equal to the torch path": _equal_to_the_torch_path,
          "tensor parallel": _tensor_parallel, "linear": _linear_single,
          "linear tensor parallel": _linear_tensor_parallel}


def _run_in_child() -> None:
    for name, check in CHECKS.items():
        try:
            check()
            print(f"CHECK {name}: PASS", flush=True)
        except BaseException:  # noqa: BLE001 - reported to the parent
            print(f"CHECK {name}: FAIL\n{traceback.format_exc()}", flush=True)


@pytest.fixture(scope="module")
def interpreted_report() -> str:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", "import tests.parallel.test_vocab_kernels as t; t._run_in_child()"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    return proc.stdout + f"\n[exit {proc.returncode}]\n" + proc.stderr[-4000:]


@pytest.mark.parametrize("name", list(CHECKS))
def test_interpreted_kernels(interpreted_report, name):
    assert f"CHECK {name}: PASS" in interpreted_report, interpreted_report


@pytest.mark.gpu
def test_compiled_kernels_on_cuda_match_reference():
    assert use_triton_kernels(torch.zeros(1, device="cuda"))
    _check(_run_cases(None, 0, 1, device="cuda", chunks=(None,)))


@pytest.mark.gpu
def test_compiled_kernels_in_the_fused_output_layer_on_cuda():
    """The fused output layer on CUDA (kernels) against float64, its bf16 and float32 weights."""
    from hapo_megatron.parallel.linear import linear_logprobs_entropy
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(64, 32, generator=g), torch.randn(5000, 32, generator=g) * 0.5
    targets = torch.randint(0, 5000, (64,), generator=g)
    exact = torch.log_softmax(hidden.double() @ weight.double().t(), dim=-1)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        lp, ent = linear_logprobs_entropy(hidden.to("cuda", dtype), weight.to("cuda", dtype), targets.cuda(),
                                          temperature=1.0, chunk_size=16)
        ref_lp = exact.gather(1, targets.unsqueeze(1)).squeeze(1)
        ref_ent = -(exact.exp() * exact).sum(-1)
        assert (lp.double().cpu() - ref_lp).abs().max() < tol and (ent.double().cpu() - ref_ent).abs().max() < tol
