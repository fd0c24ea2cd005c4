"""What a failed rollout server costs (docs/multinode.md, "Fault tolerance of the rollout servers"):
two CPU SGLang servers on the tiny model, one SIGKILLed in the middle of a seeded round.

Prints: the rows retried, how many rows of that round differ from the same round without a
failure (same weights; greedy by default, ``--temperature`` for sampled rows with per-row seeds),
the restart time (kill -> answering /health) and the time until the server is back in use (kill ->
after the next weight sync). SGLang 0.5.23 uses ``sampling_seed`` only with
``--enable-deterministic-inference`` (``--deterministic``), which it refuses with the torch-native
attention of CPU servers: on CPU a sampled row draws fresh randomness on every try.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python tools/bench/server_recovery.py
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python tools/bench/server_recovery.py --prompts 8 --max-new-tokens 4  # quick

``--standin`` runs the same sequence (kill, retries, restart, sync) on stand-in servers
(``tests/rollout/sglang/standin_sglang_server.py``: no model, so its token figures mean nothing):
``tests/tools/test_bench_server_recovery.py`` runs it that way, so that the benchmark is checked
without two CPU SGLang start-ups; the real servers' recovery is tested in
``tests/rollout/sglang/test_server_recovery_real.py``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from hapo_megatron.config import SGLangConfig  # noqa: E402
from hapo_megatron.rollout.sglang import engine as se  # noqa: E402
from hapo_megatron.rollout.sglang import launch as launcher  # noqa: E402
from hapo_megatron.rollout.sglang.api_key import new_api_key  # noqa: E402
from hapo_megatron.rollout.engine import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deterministic", action="store_true", help="servers honour sampling_seed")
    ap.add_argument("--prompts", type=int, default=12, help="x 2 rows, 4 a call: at least 8 (server 1 gets 2 calls)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--standin", action="store_true", help="stand-in servers in place of SGLang (a smoke run)")
    args = ap.parse_args()
    if args.prompts < 8:
        ap.error("--prompts must be at least 8: the kill comes before server 1's second call of the round")
    from tests.rollout.sglang.real_sglang import tiny_model_dir
    from tests.rollout.sglang.test_server_recovery_real import perturbed

    root = tempfile.mkdtemp(prefix="hapo_recovery_")
    model = tiny_model_dir(root)
    key, extra = new_api_key(), (["--enable-deterministic-inference"] if args.deterministic else [])
    env = launcher.server_env(cpu=True)
    if args.standin:  # the stand-in records its requests there, and is found on the path
        standin_dir = os.path.join(ROOT, "tests", "rollout", "sglang")
        env.update(HAPO_TEST_STANDIN_DIR=root,
                   PYTHONPATH=os.pathsep.join(filter(None, [standin_dir, env.get("PYTHONPATH")])))
    handles = []
    for i in range(2):
        port = launcher.free_port()
        cmd = launcher.server_command(model, port=port, device="cpu", dtype="float32", max_total_tokens=4096,
                                      extra_args=extra,
                                          mem_fraction_static=0.7, quantization='none', kv_cache_dtype='auto')
        if args.standin:  # the keyed launcher runs the module named in its -c program
            cmd[2] = cmd[2].replace("sglang.launch_server", "standin_sglang_server")
        handles.append(launcher.start_process(cmd, f"http://127.0.0.1:{port}", log_path=os.path.join(root, f"s{i}.log"),
                                              env=env, api_key=key))
    try:
        section = SGLangConfig(colocate=True, weight_sync="tensor", max_retries=0, request_timeout_s=120)
        eng = se.SGLangEngine(section, servers=handles, launch=False, send_sampling_seed=True, requests_per_call=4,
                              api_key=key, model_path=model, launch_timeout_s=900, quantization="none",
                              kv_cache_dtype="auto")
        eng.update_weights(iter(perturbed(model, 1)))
        prompts = [[1, 10 + p, 11, 12 + p] for p in range(args.prompts)]
        params = SamplingParams(n=2, temperature=args.temperature, top_p=1.0, top_k=-1,
                                max_new_tokens=args.max_new_tokens, ignore_eos=True, seed=11)
        flat = lambda out: [(list(s.response_ids), list(s.rollout_logprobs)) for g in out for s in g]  # noqa: E731
        ref, again = flat(eng.generate(prompts, params)), flat(eng.generate(prompts, params))
        killed, request, calls = [], eng.http.request, []

        def faulty(server, path, *a, **kw):  # kill server 1 before its second call: mid-round
            if server is handles[1] and path == "/generate":
                calls.append(1)
                if len(calls) == 2:
                    killed.append(time.monotonic())
                    os.killpg(handles[1].process.pid, signal.SIGKILL)
            return request(server, path, *a, **kw)

        eng.http.request = faulty
        out = flat(eng.generate(prompts, params))
        eng.http.request = request
        ids_diff = sum(a[0] != b[0] for a, b in zip(out, ref))
        lp_diff = max((abs(x - y) for a, b in zip(out, ref) if a[0] == b[0] for x, y in zip(a[1], b[1])), default=0.0)
        print(f"rows: {len(ref)}; retried: {eng.fault_metrics()['rollout/requests_retried']:.0f}")
        again_lp = max((abs(x - y) for a, b in zip(again, ref) if a[0] == b[0] for x, y in zip(a[1], b[1])),
                       default=0.0)
        print(f"no failure, run twice: {sum(a[0] != b[0] for a, b in zip(again, ref))} rows with other tokens, "
              f"max |logprob diff| {again_lp:.2e}")
        print(f"with the kill: {ids_diff} rows with other tokens than without it; "
              f"max |logprob diff| on the others {lp_diff:.2e}")
        eng.http.wait_healthy(handles[1], 900, poll_s=0.5)
        healthy = time.monotonic() - killed[0]
        eng.update_weights(iter(perturbed(model, 2)))
        print(f"restarted server answering {healthy:.1f} s after the kill; back in use after the next sync at "
              f"{time.monotonic() - killed[0]:.1f} s (state {eng.supervisor.state})")
    finally:
        for h in handles:
            launcher.stop_process(h)


if __name__ == "__main__":
    main()
