"""Asynchronous rollouts: steps per hour of the CPU job for rollout.max_staleness 0 (synchronous),
1 and 2, in one run, against stand-in servers that emit tokens at a fixed rate
(`paced_sglang_server.py`: generation costs wall time, not the trainer's CPU, as on a GPU box).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python tools/bench/async_rollout.py            # the figures
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python tools/bench/async_rollout.py --small    # seconds

The token rate is calibrated so that one step's generation takes about as long as one step's
training (measured on a first synchronous run: ``--gen-train-ratio``). Each setting runs
``--steps`` steps after ``--warmup`` warm-up steps; steps per hour come from the wall time between the
first and the last logged step (``perf/step_time_s`` would hide the overlap). The trainer's idle
fraction is the time it waited for data (``timing/trainer_wait_s``, asynchronous) or generated
(``timing/rollout_s``, synchronous) over the wall time; "busy s/step" is the rest, the trainer's
own work per step (it grows when generation competes for the machine's cores). ``--repeats`` runs
the three settings in turn that many times (a change in the machine's load meets each alike); the
steps per hour of the median step time are printed too (a burst of load from other processes
slows a few steps of one setting and moves the mean, not the median).
The reward is a cheap parity score (the stand-in's responses are random tokens): on the CPU job
the math verifier's CPU time would compete with the trainer for the cores while generation
overlaps training, which it does not on a GPU box.

``--servers sglang`` (the GPU mode) measures the same with real SGLang servers that each
setting's trainer launches, the user's path with the default weight sync; generation then runs at
the servers' own speed (no calibration). On a GPU node, with ``--model`` a real model:

    PYTHONPATH=$PWD python tools/bench/async_rollout.py --servers sglang --model /models/Qwen2.5-Math-1.5B \
        --length 512 --batch 32 --n 8

(the trainer on GPU 0, the servers on the next ones). On CPU the tiny model runs on CPU servers
that share the trainer's cores, which only checks that the mode works.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVER = os.path.join(ROOT, "tools", "bench", "paced_sglang_server.py")
CONFIG = os.path.join(ROOT, "examples", "cpu_tiny", "config.yaml")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs import kill_tree  # noqa: E402


def start_servers(n: int, tokens_per_s: float, record_dir: str, vocab: int = 40,
                  extra: tuple = ()) -> tuple[list, list[str]]:
    """``n`` paced stand-in servers on free ports; (processes, URLs) once they answer /health.
    ``extra[i]``: more arguments of server ``i``. A server whose port was taken meanwhile starts
    again on another; on failure the ones started are stopped."""
    from hapo_megatron.rollout.sglang.client import SGLangHTTP, ServerDiedError, ServerHandle
    from hapo_megatron.rollout.sglang.launch import free_port
    procs, urls = [], []
    env = {**os.environ, "HAPO_TEST_STANDIN_DIR": record_dir}
    http = SGLangHTTP(timeout_s=10, max_retries=0)
    try:
        for i in range(n):
            more = list(extra[i]) if i < len(extra) else []
            for attempt in range(5):
                port = free_port()
                proc = subprocess.Popen([sys.executable, SERVER, "--port", str(port), "--tokens-per-s",
                                         str(tokens_per_s), "--vocab", str(vocab), *more], env=env)
                try:
                    http.wait_healthy(ServerHandle(url=f"http://127.0.0.1:{port}", process=proc), timeout_s=60,
                                      poll_s=0.1)
                    break
                except ServerDiedError:  # the port went to someone else between free_port and bind
                    if attempt == 4:
                        raise
            procs.append(proc)
            urls.append(f"http://127.0.0.1:{port}")
    except BaseException:
        stop_servers(procs)
        raise
    return procs, urls


def stop_servers(procs) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=30)


def job_overrides(data: str, run_dir: str, urls: list[str] | None, *, max_staleness: int, steps: int,
                  batch: int = 4, n: int = 4, response_length: int = 16, reward_workers: int = 0,
                  rollout_is: str | None = None, extra: dict | None = None,
                  launched: LaunchedServers | None = None) -> list[str]:
    """The tiny CPU job (examples/cpu_tiny, one process, TP 1) on the stand-in servers at ``urls``
    (synced by disk), or on real SGLang servers that the trainer launches (``launched``: the
    user's path, the default weight sync)."""
    kv = {
        "data.train_files": f"[{data}/train.jsonl]", "data.val_files": "[]",
        "data.tokenizer_path": f"{data}/model", "model.hf_model_path": f"{data}/model",
        "data.train_batch_size": batch, "trainer.ppo_mini_batch_size": batch, "rollout.n": n,
        "rollout.max_response_length": response_length, "reward.overlong_buffer_enable": "false",
        "trainer.sft_warmup_steps": 0, "trainer.total_steps": steps, "trainer.save_interval": 0,
        "trainer.run_dir": run_dir, "logging.console": "false", "trainer.val_before_train": "false",
        "trainer.val_at_end": "false", "algo.filter_groups": "false", "reward.num_workers": reward_workers,
        "parallel.tensor_model_parallel_size": 1, "rollout.engine": "sglang", "rollout.sglang.colocate": "false",
        "rollout.max_staleness": max_staleness,
        "algo.rollout_is": rollout_is or ("token_tis" if max_staleness else "none"),
    }
    if launched is None:
        kv.update({"rollout.sglang.server_urls": "[" + ",".join(urls or ()) + "]",
                   "rollout.sglang.weight_sync": "disk"})
    else:
        kv.update(launched.overrides())
    kv.update(extra or {})
    return [f"{k}={v}" for k, v in kv.items()]


@dataclass(frozen=True)
class LaunchedServers:
    """``--servers sglang``: real SGLang servers that each setting's trainer launches (its own
    GPUs after the trainer's on a GPU node, CPU servers here), serving ``model`` (an HF directory
    with its tokenizer; the trainer trains the same model) on prompts from ``train_file``."""
    model: str
    train_file: str
    num_servers: int = 1

    def overrides(self) -> dict:
        from hapo_megatron.rollout.sglang.launch import free_port
        # bf16 as the GPU recipes train and serve (the CPU job's fp32 would double a real model's
        # memory and time); without CUDA the trainer and its servers run in fp32 whatever this says
        return {"rollout.sglang.num_servers": self.num_servers, "rollout.sglang.port_base": free_port(),
                "model.dtype": "bf16", "model.hf_model_path": self.model, "data.tokenizer_path": self.model,
                "data.train_files": f"[{self.train_file}]"}


def run_job(data: str, run_dir: str, overrides: list[str], timeout: float = 900, *,
            module: str = "hapo_megatron.train", env: dict | None = None, returncode: int = 0,
            torchrun: bool = True) -> list[dict]:
    """One training process (``python -m module``, default the trainer; under torchrun, whose
    exit code is 1 for any failure, unless ``torchrun=False``) that must exit with ``returncode``;
    returns its metrics.jsonl records."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "HAPO_SGLANG_SYNC_DIR": os.path.join(run_dir, "sync"), **(env or {})}
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"] if torchrun else []
    cmd = [sys.executable, *launch, "-m", module, "--config", CONFIG, *overrides]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise
    if proc.returncode != returncode:
        raise RuntimeError(f"exit code {proc.returncode}, expected {returncode}:\n" + out[-3000:] + err[-6000:])
    return read_metrics(run_dir)


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "rollout/reward_mean" in r]


def proc_cpu_s(procs) -> float:
    """CPU seconds (user + system) the processes ``procs`` (Popen objects) have used so far."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for p in procs:
        with open(f"/proc/{p.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


#: per-step CPU figures of the trainer (means over the measured steps; docs/architecture.md,
#: "Where the trainer's time goes")
HOST = {"producer_cpu": "timing/producer_cpu_s", "process_cpu": "perf/host_process_cpu_s",
        "main_cpu": "perf/host_main_thread_cpu_s", "main_runqueue": "perf/host_main_thread_runqueue_s",
        "torch_threads": "perf/host_torch_threads", "gil_probe_frac": "perf/host_gil_probe_wait_frac"}


def summarize(recs: list[dict], *, warmup: int = 2) -> dict[str, float]:
    """Steps per hour and the trainer's idle fraction over the steps after ``warmup``."""
    rows = recs[warmup:]
    wall = sum(r["perf/step_time_s"] for r in rows)
    idle = sum(r.get("timing/trainer_wait_s", r.get("timing/rollout_s", 0.0)) for r in rows)
    gen = [r.get("timing/rollout_s", 0.0) for r in rows]
    return combine([{"steps": len(rows), "wall_s": wall, "idle_s": idle, "rollout_s_sum": sum(gen),
                     "step_times": [r["perf/step_time_s"] for r in rows],
                     "staleness_max": max((r.get("rollout/staleness_max", 0.0) for r in rows), default=0.0),
                     **{k: sum(r.get(key, 0.0) for r in rows) for k, key in HOST.items()}}])


def combine(parts: list[dict]) -> dict[str, float]:
    """The figures of several runs of one setting together (their steps and wall times summed)."""
    steps, wall = sum(p["steps"] for p in parts), sum(p["wall_s"] for p in parts)
    idle, gen = sum(p["idle_s"] for p in parts), sum(p["rollout_s_sum"] for p in parts)
    times = sorted(t for p in parts for t in p["step_times"])
    median = (times[(len(times) - 1) // 2] + times[len(times) // 2]) / 2 if times else 0.0
    host = {k: sum(p.get(k, 0.0) for p in parts) for k in (*HOST, "server_cpu")}
    return {**host, **{f"{k}_per_step": v / max(steps, 1) for k, v in host.items()},
            "steps": steps, "wall_s": wall, "idle_s": idle, "rollout_s_sum": gen, "step_times": times,
            "steps_per_hour": 3600.0 * steps / max(wall, 1e-9), "idle_frac": idle / max(wall, 1e-9),
            # robust to a burst of load from other processes on a shared machine (a few slow steps)
            "steps_per_hour_median": 3600.0 / max(median, 1e-9),
            "busy_s_per_step": (wall - idle) / max(steps, 1), "rollout_s_mean": gen / max(steps, 1),
            "staleness_max": max(p["staleness_max"] for p in parts)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16, help="measured steps (after the warm-up steps)")
    ap.add_argument("--warmup", type=int, default=4, help="steps left out of the figures (start-up costs)")
    ap.add_argument("--batch", type=int, default=16, help="prompts per step")
    ap.add_argument("--n", type=int, default=8, help="responses per prompt")
    ap.add_argument("--length", type=int, default=24, help="response tokens")
    ap.add_argument("--small", action="store_true", help="3 steps, tiny responses (the suite's smoke test)")
    ap.add_argument("--gen-train-ratio", type=float, default=1.0,
                    help="generation time / training time per step that the token rate is set to")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of the three settings, in turn (figures over all rounds: a change in the "
                         "machine's load meets every setting alike)")
    ap.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--rollout-is", default="token_tis",
                    help="algo.rollout_is of every setting (the same algorithm in all three: with adaptive "
                         "temperature the correction costs a second forward pass, in the synchronous run too)")
    ap.add_argument("--producer", choices=("process", "thread"), default="process",
                    help="rollout.async_producer of the asynchronous settings (the rollout manager process, or "
                         "threads in the trainer)")
    ap.add_argument("--length-median", type=float, default=0.0,
                    help="heavy-tailed response lengths (the stand-in's lognormal of this median, capped at "
                         "--length; 0: every response runs to --length)")
    ap.add_argument("--over-sampling", type=float, default=1.0,
                    help="> 1: the settings are max_staleness 0, 1, and 1 with rollout.over_sampling at this factor "
                         "(docs/architecture.md, 'Over-sampling under asynchronous rollouts')")
    ap.add_argument("--gil-probe", action="store_true",
                    help="run the trainers with HAPO_GIL_PROBE=1 (training/metrics/host_cpu.py): the probe "
                         "thread's wait for the interpreter lock, as a fraction of the wall time")
    ap.add_argument("--servers", choices=("paced", "sglang"), default="paced",
                    help="paced: the stand-ins at a calibrated token rate (generation costs wall time, no CPU); "
                         "sglang: real SGLang servers that each setting's trainer launches, with the default "
                         "weight sync (the GPU mode: servers on the GPUs after the trainer's, so a node needs "
                         "1 + --num-servers GPUs; on CPU, CPU servers sharing the trainer's cores)")
    ap.add_argument("--model", default=None,
                    help="--servers sglang: the HF model directory (with its tokenizer) trained and served "
                         "(default: the tiny random model of the CPU job)")
    ap.add_argument("--train-file", default=None,
                    help="--servers sglang: the prompts (a prepared train file; default: the tiny task's)")
    ap.add_argument("--num-servers", type=int, default=1, help="--servers sglang: servers per setting")
    args = ap.parse_args(argv)
    if args.servers == "paced" and (args.model or args.train_file):
        ap.error("--model and --train-file need --servers sglang")
    env = {"HAPO_GIL_PROBE": "1"} if args.gil_probe else None
    steps = 1 if args.small else args.steps
    warmup = 2 if args.small else args.warmup
    length = 4 if args.small else args.length
    size = dict(batch=2, n=2) if args.small else dict(batch=args.batch, n=args.n)
    size["reward_workers"] = 0
    # a reward that costs no CPU (the stand-in's responses are random tokens): on a GPU box the
    # CPU work of scoring does not slow the trainer; on this CPU job it would compete for the cores
    size["extra"] = {"reward.reward_fn": "tests.training.parity_reward:score",
                     "rollout.async_producer": args.producer}
    size["rollout_is"] = args.rollout_is
    work = args.out or tempfile.mkdtemp(prefix="hapo_async_bench_")
    sys.path.insert(0, ROOT)
    from tests.training.tiny_setup import prepare_tiny
    data = prepare_tiny(os.path.join(work, "data"), 256, 4)
    rec_dir = os.path.join(work, "servers")
    os.makedirs(rec_dir, exist_ok=True)
    launched = None
    if args.servers == "sglang":
        launched = LaunchedServers(model=os.path.abspath(args.model or os.path.join(data, "model")),
                                   train_file=os.path.abspath(args.train_file or os.path.join(data, "train.jsonl")),
                                   num_servers=args.num_servers)
        train_s = rate = float("nan")  # real generation: nothing to calibrate
    elif args.small:  # the suite's smoke test: no calibration, a fixed rate
        train_s = 0.2
    else:  # calibration: a synchronous run with fast servers measures the training time per step
        procs, urls = start_servers(2, 2000.0, rec_dir)
        try:
            cal = summarize(run_job(data, os.path.join(work, "calibrate"),
                                    job_overrides(data, os.path.join(work, "calibrate"), urls, max_staleness=0,
                                                  steps=warmup + 4, response_length=length, **size)),
                            warmup=warmup)
        finally:
            stop_servers(procs)
        train_s = cal["busy_s_per_step"]
    if launched is None:  # one step generates batch x n rows, one request per group (all at once)
        rate = length / max(args.gen_train_ratio * train_s, 1e-3)
    # setting label -> (max_staleness, rollout.over_sampling)
    settings = ({"0": (0, 1.0), "1": (1, 1.0), f"1 os{args.over_sampling:g}": (1, args.over_sampling)}
                if args.over_sampling > 1.0 else {"0": (0, 1.0), "1": (1, 1.0), "2": (2, 1.0)})
    parts: dict[str, list[dict]] = {label: [] for label in settings}
    tail = ("--length-median", str(args.length_median)) if args.length_median > 0 else ()
    procs, urls = start_servers(2, rate, rec_dir, extra=(tail, tail)) if launched is None else ([], None)
    try:
        for rep in range(args.repeats):
            for label, (k, over) in settings.items():
                run_dir = os.path.join(work, f"setting_{label.replace(' ', '_')}" + (f"_{rep}" if rep else ""))
                cpu0 = proc_cpu_s(procs)
                over_kw = {**size, "extra": {**size["extra"], "rollout.over_sampling": over}}
                recs = run_job(data, run_dir, job_overrides(
                    data, run_dir, urls, max_staleness=k, steps=steps + warmup, response_length=length,
                    launched=launched, **over_kw), env=env)
                part = summarize(recs, warmup=warmup)
                # the stand-ins' CPU over the whole job (start-up and warm-up too), per step of it
                # (launched servers are the trainer's children: not measured)
                part["server_cpu"] = ((proc_cpu_s(procs) - cpu0) * part["steps"] / max(len(recs), 1)
                                      if launched is None else float("nan"))
                parts[label].append(part)
    finally:
        stop_servers(procs)
    results = {k: combine(p) for k, p in parts.items()}
    base = results["0"]["steps_per_hour"]
    if launched is None:
        print(f"training {train_s:.2f} s/step (calibration), token rate {rate:.1f}/s -> generation "
              f"~{length / rate:.2f} s/step; {args.repeats} round(s) of {steps} steps per setting")
    else:
        print(f"{launched.num_servers} SGLang server(s) launched by each setting's trainer, model {launched.model}: "
              f"generation {results['0']['rollout_s_mean']:.2f} s/step, training "
              f"{results['0']['busy_s_per_step']:.2f} s/step (synchronous run); {args.repeats} round(s) of "
              f"{steps} steps per setting")
    base_median = results["0"]["steps_per_hour_median"]
    base_busy = results["0"]["busy_s_per_step"]
    print(f"{'max_staleness':>13} {'steps/h':>9} {'ratio':>6} {'idle':>6} {'busy s/step':>11} {'busy ratio':>10} "
          f"{'steps/h (median step)':>21} {'ratio':>6} {'staleness_max':>13}")
    for k, r in results.items():
        print(f"{k:>13} {r['steps_per_hour']:>9.0f} {r['steps_per_hour'] / base:>6.2f} {r['idle_frac']:>6.2f} "
              f"{r['busy_s_per_step']:>11.2f} {r['busy_s_per_step'] / max(base_busy, 1e-9):>10.2f} "
              f"{r['steps_per_hour_median']:>21.0f} "
              f"{r['steps_per_hour_median'] / base_median:>6.2f} {r['staleness_max']:>13.0f}")
    print(f"per step (s), means over the measured steps: the producer's CPU ({args.producer}: "
          + ("the rollout manager process" if args.producer == "process" else "threads in the trainer's process")
          + "), the trainer process's CPU, its main thread's CPU and run-queue wait, the two stand-ins' CPU"
          + (" (nan: launched servers are not measured)" if launched is not None else ""))
    print(f"{'max_staleness':>13} {'producer':>9} {'process':>8} {'main':>6} {'runqueue':>8} {'servers':>8} "
          f"{'torch threads':>13}" + (f" {'gil probe':>9}" if args.gil_probe else ""))
    for k, r in results.items():
        print(f"{k:>13} {r['producer_cpu_per_step']:>9.3f} {r['process_cpu_per_step']:>8.3f} "
              f"{r['main_cpu_per_step']:>6.3f} {r['main_runqueue_per_step']:>8.3f} {r['server_cpu_per_step']:>8.3f} "
              f"{r['torch_threads_per_step']:>13.0f}"
              + (f" {r['gil_probe_frac_per_step']:>9.3f}" if args.gil_probe else ""))
    return {"train_s": train_s, "rate": rate, "results": results}


if __name__ == "__main__":
    main()
