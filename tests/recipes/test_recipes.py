"""Every GPU recipe of examples/ runs 2 RL steps on CPU from its own config.yaml, launched its own
way (its train.sh -> examples/launch.sh -> torchrun; the async recipe: its launch_servers.sh, then
its launch_trainer.sh), with the SGLang servers the trainer launches (or the recipe's own
attached-server launch). Only sizes shrink (tiny_recipe.py); a switch that cannot run on CPU gets
its counterpart from the one table, cpu_counterparts.py, and the test prints every substitution.

Asserted per recipe: 2 steps in metrics.jsonl with a finite loss and no skipped update, the
weight sync in the recipe's mode (the servers' own access logs: the endpoint of that mode, once
per step at least; distributed: the group's backend in the server log), the recipe's switches
at work (asynchronous: staleness and weight-version metrics; MoE with routing replay: the
routing-mismatch and router metrics; colocated: release / resume requests), the evaluations the
recipe asks for, and no SGLang server left once the run ended.

One test per recipe folder (the test id is the folder's name); qwen2.5-math-7b-sglang resolves to
the same config as qwen2.5-math-7b after shrinking (asserted) and reuses its run.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import time

import psutil
import pytest

from hapo_megatron.config import load_config
from hapo_megatron.training.metrics.sinks import read_jsonl
from tests.recipes import cpu_counterparts as cpu
from tests.recipes import tiny_recipe as tiny
from tests.tools._load import load_tool

pytestmark = pytest.mark.slow
kill_tree = load_tool("bench/procs").kill_tree

#: every GPU recipe folder of examples/ (test_every_gpu_recipe_is_listed keeps the list complete)
RECIPES = ("qwen2.5-math-1.5b", "qwen2.5-math-7b", "qwen2.5-math-7b-async", "qwen2.5-math-7b-lora",
           "qwen2.5-math-7b-sglang", "qwen3-30b-a3b", "qwen3-8b")
STEPS = 2
#: a run's time limit (a loaded 2-core machine starts a CPU server in up to 2 minutes)
RUN_TIMEOUT_S = 1200
#: recipes blocked by a known defect fixed on another branch: they fail within this limit instead
#: of hanging (empty since main has `syncrun`'s hosted weight-sync store)
KNOWN_DEFECT_TIMEOUT_S: dict[str, float] = {}
#: recipes whose shrunk config equals another's: they assert it and share that recipe's run
SAME_RUN = {"qwen2.5-math-7b-sglang": "qwen2.5-math-7b"}
#: the server endpoint of each weight-sync mode
SYNC_ENDPOINTS = {"tensor": "update_weights_from_tensor", "distributed": "update_weights_from_distributed",
                  "disk": "update_weights_from_disk"}
#: launched CPU servers at most (each takes ~1.5 GB and 20-45 s of start-up on 2 cores, minutes on
#: a loaded machine: the most of a recipe run): one server, except in MULTI_SERVER_RECIPE
MAX_SERVERS = 1
#: the recipe that keeps 2 launched servers (its own plan on 2 ranks, no server count override):
#: generation spread over both, each one synced every step and stopped after the run
MULTI_SERVER_RECIPE, MULTI_SERVERS = "qwen2.5-math-1.5b", 2


# --------------------------------------------------------------------------- sizes
def layout_overrides(cfg, max_servers: int = MAX_SERVERS) -> tuple[int, list[str], list[str]]:
    """(ranks, overrides, printed lines): the recipe's TP and PP on TP x PP x CP ranks, at most 4
    (CP's ranks train data-parallel, the counterparts table; past 4 they are left out), EP as
    large as those ranks and the tiny model's experts allow; at most ``max_servers`` launched servers."""
    p = cfg.parallel
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    if tp * pp > 4:
        raise AssertionError(f"TP {tp} x PP {pp} does not fit 4 CPU ranks: no shrink rule for this layout yet")
    ranks = min(4, tp * pp * cp)
    lines = [f"ranks: {ranks} (the recipe's TP {tp} x PP {pp} x CP {cp} per model replica)"]
    out = []
    ep = p.expert_model_parallel_size
    if ep > 1:
        room = ranks // pp // p.expert_tensor_parallel_size
        small = max(d for d in range(1, min(ep, room, tiny.TINY_MOE["num_experts"]) + 1)
                    if room % d == 0 and tiny.TINY_MOE["num_experts"] % d == 0)
        if small != ep:
            out.append(f"parallel.expert_model_parallel_size={small}")
            lines.append(f"EP {ep} -> {small} ({room} ranks per pipeline stage, "
                         f"{tiny.TINY_MOE['num_experts']} experts)")
    sg = cfg.rollout.sglang
    if cfg.rollout.engine == "sglang" and not sg.server_urls and (sg.num_servers or ranks) > max_servers:
        # num_servers=0 fills the node: one server per rank once servers have 1 process (the table)
        out.append(f"rollout.sglang.num_servers={max_servers}")
        lines.append(f"servers: {sg.num_servers or 'one per server_tp_size ranks'} -> {max_servers}")
    return ranks, out, lines


def size_overrides(data: dict, model_dir: str, run_dir: str) -> list[str]:
    """The recipe's sizes shrunk: tiny data and model, 2 prompts x 4 responses of <= 16 tokens per
    step, 2 updates per step, 2 steps; the run in ``run_dir``."""
    return [f"data.train_files=[{data['train']}]", f"data.val_files=[{data['val']}]",
            f"model.hf_model_path={model_dir}", "data.max_prompt_length=64", "data.train_batch_size=2",
            "trainer.ppo_mini_batch_size=1", "rollout.n=4", "rollout.max_response_length=16", "rollout.val_n=2",
            "reward.overlong_buffer_len=4", f"trainer.total_steps={STEPS}", f"trainer.run_dir={run_dir}"]


def port_override() -> str:
    """Launched servers listen from a port free on this machine (the recipes' 30000 may be taken
    by another job's servers on a shared machine)."""
    from hapo_megatron.rollout.sglang.launch import free_port
    return f"rollout.sglang.port_base={free_port()}"


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The tiny data set and one tiny model per recipe family (shared by every recipe here)."""
    from tests.rollout.sglang.real_sglang import require_sglang

    require_sglang()
    root = tmp_path_factory.mktemp("recipes_tiny")
    data, rows = tiny.write_tiny_data(str(root / "data"))
    return data, tiny.prepare_family_models(str(root / "models"), RECIPES, rows[:16])


def _sglang_processes(marker: str) -> list[psutil.Process]:
    """Live SGLang server processes (launch_server or serve) whose command line holds ``marker``,
    and their descendants (the schedulers rename themselves)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or ())
        if marker in cmd and ("sglang.launch_server" in cmd or "hapo_megatron.rollout.sglang.serve" in cmd):
            try:
                found += [proc, *proc.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
    return list({p.pid: p for p in found}.values())


def _end(procs: list[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


class RecipeRun:
    """One recipe's launch: its command(s), output, metrics and server logs."""

    def __init__(self, recipe: str, prepared, root: str):
        self.recipe, self.run_dir = recipe, os.path.join(root, recipe)
        data, models = prepared
        self.model_dir = models[recipe]
        base = load_config(tiny.recipe_config_path(recipe))
        self.rows, table_overrides = cpu.counterparts_for(base)
        self.missing = cpu.unmatched(base)
        servers = MULTI_SERVERS if recipe == MULTI_SERVER_RECIPE else MAX_SERVERS
        self.ranks, layout, self.layout_lines = layout_overrides(base, servers)
        self.overrides = size_overrides(data, self.model_dir, self.run_dir) + layout + table_overrides
        self.attached = os.path.isfile(os.path.join(tiny.EXAMPLES, recipe, "launch_servers.sh"))
        if not self.attached:
            self.overrides.append(port_override())
        self.cfg = load_config(tiny.recipe_config_path(recipe), self.overrides)
        if self.attached:  # servers started by the recipe's own script, the trainer attached by URL
            self.layout_lines.append("launch_servers.sh: NUM_SERVERS 8 -> 1, SERVER_HOST=127.0.0.1 (the serving "
                                     "node is this machine)")
        self.output, self.returncode, self.wall_s, self.left_over = "", None, 0.0, []

    def describe(self) -> str:
        return (f"{self.recipe}: CPU counterparts (cpu_counterparts.TABLE):\n{cpu.describe(self.rows)}\n"
                f"  sizes: {' '.join(self.overrides)}\n  layout: " + "; ".join(self.layout_lines))

    def env(self) -> dict:
        return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "GPUS_PER_NODE": str(self.ranks),
                "PYTHONPATH": os.pathsep.join(filter(None, [tiny.ROOT, os.environ.get("PYTHONPATH")]))}

    def run(self) -> "RecipeRun":
        timeout = KNOWN_DEFECT_TIMEOUT_S.get(self.recipe, RUN_TIMEOUT_S)
        t0 = time.monotonic()
        try:
            if self.attached:
                self._run_attached(timeout)
            else:
                self._run_launched(timeout)
        finally:
            self.wall_s = time.monotonic() - t0
            time.sleep(1.0)  # a server's process group gets its SIGTERM / SIGKILL before we look
            self.left_over = _sglang_processes(self.model_dir)
            _end(self.left_over)  # whatever the verdict, the next recipe starts on a clean machine
        return self

    def _trainer(self, cmd: list[str], timeout: float, env: dict) -> None:
        """Run the trainer's launch command; its output goes to ``<run_dir>.out`` (and ``output``)."""
        with open(self.run_dir + ".out", "w") as out:
            proc = subprocess.Popen(cmd, cwd=tiny.ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                self.returncode = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_tree(proc)
                self.returncode = f"timed out after {timeout} s"
        with open(self.run_dir + ".out", errors="replace") as f:
            self.output = f.read()

    def _run_launched(self, timeout: float) -> None:
        """The recipe's train.sh (-> examples/launch.sh -> torchrun), servers launched by the trainer."""
        self._trainer(["bash", os.path.join("examples", self.recipe, "train.sh"), *self.overrides], timeout, self.env())

    def _run_attached(self, timeout: float) -> None:
        """launch_servers.sh (``python -m hapo_megatron.rollout.sglang.serve``), then launch_trainer.sh
        attached to the URLs it wrote, both with the recipe's SHARED_DIR = the run directory."""
        from hapo_megatron.rollout.sglang.launch import free_port

        here = os.path.join("examples", self.recipe)
        env = {**self.env(), "SHARED_DIR": self.run_dir, "MODEL_PATH": self.model_dir, "NUM_SERVERS": "1",
               "SERVER_HOST": "127.0.0.1", "SGLANG_PORT_BASE": str(free_port()),
               "RUN_NAME": self.cfg.trainer.experiment_name}
        os.makedirs(self.run_dir, exist_ok=True)
        log = open(os.path.join(self.run_dir, "launch_servers.out"), "w")
        servers = subprocess.Popen(["bash", os.path.join(here, "launch_servers.sh")], cwd=tiny.ROOT, env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        try:
            url_file = os.path.join(self.run_dir, "server_urls")
            while not os.path.exists(url_file):
                if servers.poll() is not None or time.monotonic() > deadline:
                    self.returncode = f"launch_servers.sh ended ({servers.poll()}) or timed out before its URLs"
                    return
                time.sleep(0.5)
            trainer_args = [o for o in self.overrides if not o.startswith(("model.hf_model_path=", "trainer.run_dir="))]
            self._trainer(["bash", os.path.join(here, "launch_trainer.sh"), *trainer_args],
                          max(deadline - time.monotonic(), 1.0), env)
        finally:
            servers.terminate()  # SIGTERM: serve stops its servers (its own handler)
            try:
                servers.wait(timeout=60)
            except subprocess.TimeoutExpired:
                kill_tree(servers)
            log.close()

    # ------------------------------------------------------------------ what the run left
    def records(self) -> list[dict]:
        path = os.path.join(self.run_dir, "metrics.jsonl")
        return [r for r in read_jsonl(path) if "rollout/reward_mean" in r] if os.path.exists(path) else []

    def evals(self) -> list[int]:
        path = os.path.join(self.run_dir, "metrics.jsonl")
        return [r["step"] for r in read_jsonl(path) if any(k.startswith("eval/") for k in r)] \
            if os.path.exists(path) else []

    def server_posts(self, endpoint: str) -> dict[str, int]:
        """Per server log: how many ``POST /endpoint`` it answered 200."""
        pattern = re.compile(rf'"POST /{endpoint} HTTP/1.1" 200')
        return {name: len(pattern.findall(text)) for name, text in self.server_logs().items()}

    def server_logs(self) -> dict[str, str]:
        """Each server's log text by file name."""
        logs = os.path.join(self.run_dir, "sglang_logs")
        return {n: open(os.path.join(logs, n), errors="replace").read() for n in sorted(os.listdir(logs))
                if n.endswith(".log")} if os.path.isdir(logs) else {}

    def server_log_text(self) -> str:
        return "".join(self.server_logs().values())


@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory):
    """Runs by recipe, each launched once for the module (on first use)."""
    root = str(tmp_path_factory.mktemp("recipe_runs"))
    done: dict[str, RecipeRun] = {}

    def get(recipe: str) -> RecipeRun:
        if recipe not in done:
            run = RecipeRun(recipe, prepared, root)
            print(run.describe(), flush=True)
            done[recipe] = run.run()
            print(f"{recipe}: exit {run.returncode} after {run.wall_s:.0f} s", flush=True)
        return done[recipe]
    return get


# --------------------------------------------------------------------------- checks
def _check_ran(run: RecipeRun) -> list[dict]:
    tail = run.output[-6000:]
    assert not run.missing, f"GPU-only switches without a CPU counterpart in cpu_counterparts.py: {run.missing}"
    assert run.returncode == 0, f"{run.recipe}: {run.returncode}\n{tail}"
    recs = run.records()
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1)), tail
    for r in recs:
        assert math.isfinite(r["loss/pg_loss"]), r
        assert r["actor/consecutive_skips"] == 0 and r["rollout/kept_group_frac"] > 0, r  # dynamic sampling kept groups
        assert "timing/sync_s" in r, r
    return recs


def _check_evals(run: RecipeRun) -> None:
    t = run.cfg.trainer
    want = ([0] if t.val_before_train else []) + ([STEPS] if t.val_at_end else [])
    assert run.evals() == want, (run.evals(), want)


def _check_sync(run: RecipeRun) -> None:
    """The weight sync ran in the recipe's mode: each server answered that mode's update at least
    once per step, and never another mode's."""
    mode = cpu._weight_sync(run.cfg)
    posts = run.server_posts(SYNC_ENDPOINTS[mode])
    assert posts and all(n >= STEPS for n in posts.values()), (mode, posts)
    for other in set(SYNC_ENDPOINTS) - {mode}:
        assert not any(run.server_posts(SYNC_ENDPOINTS[other]).values()), other
    if mode == "distributed":  # the NCCL group's CPU counterpart: the same group over gloo
        assert "backend=gloo" in run.server_log_text()


def _check_no_server_left(run: RecipeRun) -> None:
    assert not run.left_over, f"SGLang processes outlived the run: {[p.pid for p in run.left_over]}"


# --------------------------------------------------------------------------- one test per recipe
def test_every_gpu_recipe_is_listed():
    """A new recipe folder with a config.yaml (not cpu_*) gets its CPU run here."""
    assert sorted(tiny.gpu_recipes()) == sorted(RECIPES)


def planned_servers(cfg, ranks: int) -> int:
    """Launched servers of a shrunk recipe config (num_servers=0 fills the node: ranks / server_tp_size)."""
    sg = cfg.rollout.sglang
    return sg.num_servers or ranks // sg.server_tp_size


def test_one_recipe_keeps_two_launched_servers():
    """The other recipes run one launched server (their start-up is most of a run): this one keeps
    two, so that a recipe run still spreads generation over several servers and syncs each."""
    path = tiny.recipe_config_path(MULTI_SERVER_RECIPE)
    assert not os.path.isfile(os.path.join(tiny.EXAMPLES, MULTI_SERVER_RECIPE, "launch_servers.sh"))
    base = load_config(path)
    ranks, layout, _ = layout_overrides(base, MULTI_SERVERS)
    assert planned_servers(load_config(path, layout + cpu.counterparts_for(base)[1]), ranks) >= 2


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_on_cpu(recipe, runs, prepared):
    if recipe in SAME_RUN:
        _check_same_config(recipe, SAME_RUN[recipe], prepared)
        recipe = SAME_RUN[recipe]
    run = runs(recipe)
    print(f"{run.recipe}: {run.wall_s:.0f} s", flush=True)
    recs = _check_ran(run)
    _check_evals(run)
    _check_sync(run)
    assert run.cfg.rollout.engine == "sglang"
    if run.cfg.rollout.max_staleness:
        _check_async(run, recs)
    if not run.attached:
        # launched by the trainer, every one used (num_servers=0 fills the node: ranks / server_tp_size)
        assert len(run.server_posts("generate")) == planned_servers(run.cfg, run.ranks)
        assert all(n > 0 for n in run.server_posts("generate").values())
    if run.cfg.model.routing_replay:
        _check_moe(run, recs)
    _check_no_server_left(run)


def _check_same_config(recipe: str, other: str, prepared) -> None:
    """``recipe`` resolves to ``other``'s config with the same shrinking (run names aside)."""
    from tests.test_recipes_agree import NAMES, _flat

    a, b = (dict(_flat(RecipeRun(r, prepared, "/nonexistent").cfg.to_dict())) for r in (recipe, other))
    ports = ("rollout", "sglang", "port_base")  # a free port each (port_override)
    differ = {k: (v, b.get(k)) for k, v in a.items() if k[:2] not in NAMES and k != ports and b.get(k) != v}
    assert differ == {}


def _check_async(run: RecipeRun, recs: list[dict]) -> None:
    """max_staleness: every batch within the lag, tagged weight versions reached the trainer."""
    lag = run.cfg.rollout.max_staleness
    assert lag >= 1
    for r in recs:
        assert r["rollout/staleness_max"] <= lag, r
    assert all("rollout/generation_overlap_frac" in r for r in recs)  # the producer's own metrics
    # the off-policy correction (algo.rollout_is: token_tis) weighted every step's tokens
    assert run.cfg.algo.loss.rollout_is_mode != "none" and all("rollout_is/weight_mean" in r for r in recs)
    # every update paused generation and tagged the servers' weights with the step's version
    assert all(n >= STEPS for n in run.server_posts("pause_generation").values())


def _check_moe(run: RecipeRun, recs: list[dict]) -> None:
    """Routing replay: the servers returned their routes (started with the flag) and every step
    measured them against the actor's; the router's load-balancing loss was logged."""
    logs = run.server_logs()
    assert logs and all("'enable_return_routed_experts': True" in text for text in logs.values())  # server args
    for r in recs:
        assert "rollout/routing_mismatch" in r and "actor/moe_aux_loss" in r, sorted(r)
