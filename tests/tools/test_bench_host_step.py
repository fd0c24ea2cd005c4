"""tools/bench/host_step.py at a tiny size (each role in its own subprocess): it runs end to end
through the trainer's rollout stage (which failed once a stage started reading ``rt.actor``), DP
rank 0 alone lays out every kept response token, and of two DP ranks it lays out a part. Its
``--manager`` mode parses back exactly the answers it encoded and ships the batch intact.

Mutations tried: `check_samples` comparing ids only (the log-prob check in
`test_the_answers_the_bench_encodes_parse_back_through_the_real_path` fails); `answer_item` writing
the triples as ``[id, logprob, null]`` (both manager tests fail)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_host_step_bench_runs_and_lays_out_the_kept_tokens():
    proc = subprocess.run([sys.executable, "-W", "ignore", os.path.join(ROOT, "tools", "bench", "host_step.py"),
                           "--prompts", "32", "--n", "2", "--mean", "40", "--cap", "96", "--prompt-len", "16",
                           "--dp", "1", "2", "--gen-s", "0", "--chunk", "16"],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    laid = {dp: (int(n), int(kept)) for dp, n, kept in
            re.findall(r"DP=(\d+)\s*:.*response tokens laid out (\d+) of (\d+) kept", proc.stdout)}
    assert sorted(laid) == ["1", "2"]
    total = int(re.search(r"(\d+) response tokens", proc.stdout).group(1))
    (one, kept), (two, kept2) = laid["1"], laid["2"]
    assert kept == kept2 and 0 < kept <= total
    assert one == kept  # one DP rank trains on every kept response token
    assert 0 < two < one  # DP rank 0 of 2 lays out its share only
    assert re.search(r"rank 0: host seconds left after the last response\n\s+[\d.]+ s", proc.stdout)


def test_manager_mode_parses_what_it_encoded_and_ships_the_batch():
    """`--manager`: every token parsed equals the one encoded (checked inside the bench), the batch
    rank 0's process receives equals the one sent, and the report ends in a verdict."""
    proc = subprocess.run([sys.executable, "-W", "ignore", os.path.join(ROOT, "tools", "bench", "host_step.py"),
                           "--manager", "--prompts", "32", "--n", "4", "--mean", "60", "--cap", "128",
                           "--prompt-len", "8"],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    groups, kept, responses, tokens = map(int, re.search(
        r"(\d+) groups \((\d+) kept\), (\d+) responses, (\d+) response tokens", out).groups())
    assert kept == 32 and groups >= kept and responses == 4 * groups
    checked, total = map(int, re.search(r"parsed == encoded: (\d+) of (\d+) tokens", out).groups())
    assert checked == total == tokens > 0
    assert "received == sent: True" in out
    assert re.search(r"parse\s+[\d.]+ s .*before .* = [\d.]+x the parse now", out, re.S)
    assert re.search(r"the manager (keeps up|falls behind): .* above [\d,]+ decode tokens/s per GPU", out)


def test_the_answers_the_bench_encodes_parse_back_through_the_real_path():
    """The bench's answer bytes, decoded by the client and parsed by `answer_samples`, give the
    synthetic rollout back (routes included), and the bench's own check refuses a changed sample."""
    import numpy as np
    import pytest

    from hapo_megatron.rollout.sglang.client import SGLangHTTP
    from hapo_megatron.rollout.sglang.requests import answer_samples
    from tests.tools._load import load_tool
    bench = load_tool("bench/host_step")
    d = bench.synth(3, 4, 5, 30.0, 0.6, 40, seed=1)
    rng = np.random.default_rng(0)
    for g in range(3):
        raw, routes = bench.group_answer(d, g, 7, routes_shape=(3, 2, 16), rng=rng)
        answer = SGLangHTTP._json(bench.http_response(raw))
        smp = answer_samples(answer, [d["prompts"][g].tolist()], [(0, k) for k in range(4)], return_routes=True)
        off = np.concatenate([[0], np.cumsum(d["lengths"])])
        for k, s in enumerate(smp):
            i = g * 4 + k
            assert s.response_ids.tolist() == d["resp"][off[i]:off[i + 1]].tolist()
            assert s.rollout_logprobs.tobytes() == d["logprobs"][off[i]:off[i + 1]].tobytes()
            assert s.weight_versions.tolist() == [7] * int(d["lengths"][i])
            assert s.finish_reason == ("length" if d["lengths"][i] >= 40 else "stop")
            assert s.routed_experts.shape == (5 + d["lengths"][i] - 1, 6)
            assert np.array_equal(s.routed_experts, routes[k])
        assert bench.check_samples(smp, d, g, 7, routes) == int(d["lengths"][g * 4:g * 4 + 4].sum())
        smp[1].rollout_logprobs[-1] += 1.0
        with pytest.raises(AssertionError, match=f"group {g} row 1"):
            bench.check_samples(smp, d, g, 7, routes)
