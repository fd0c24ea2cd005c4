"""SGLangEngine against a REAL SGLang server (tiny random Llama; CPU here, GPU where present):
adaptive-temperature log-probs equal an independent transformers computation, tau=0 changes
nothing, and weights trained by the Megatron actor (TP=2 on gloo) reach the server by tensor and
by disk sync (server greedy == transformers greedy of the exported weights).

Which distribution ``return_logprob`` reports (SGLang 0.5.23, ``srt/layers/sampler.py``): the
custom logit processor runs on the raw logits, then the sampler divides by the request's
temperature and reports ``log(softmax(.))`` of that, i.e. AFTER our processor and the temperature,
BEFORE top-p / top-k filtering. With the processor that is ``log_softmax(z / T_adaptive)``."""

import pytest
import torch

from hapo_megatron.algo import adaptive_temperature, compute_entropy_stats, token_entropy
from hapo_megatron.rollout.sglang import engine as se
from hapo_megatron.rollout.engine import SamplingParams

from .real_sglang import hf_greedy, hf_model
from tests.rollout.sglang.engines import sglang_engine

PROMPTS = [[1, 10, 11, 12, 13], [1, 20, 5, 7], [1, 33, 34]]


def make_engine(url, api_key, **kw):
    kw.setdefault("weight_sync", "tensor")
    return sglang_engine(server_urls=[url], launch=False, colocate=True, max_retries=0,
                           request_timeout_s=300, api_key=api_key, **kw)


def peaked_model(model_dir):
    """The tiny random model with its output layer scaled up: a random init is near-uniform (all
    entropies ~log V, std ~1e-4, so h_hat would amplify float32 rounding); scaled, the next-token
    entropies spread over ~0.4-2.3 nats like a trained model's."""
    model = hf_model(None, model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


def model_stats(model, t_base):
    """Entropy statistics of the model's own next-token distributions on PROMPTS (so h_hat spreads)."""
    with torch.no_grad():
        ent = torch.cat([token_entropy(model(input_ids=torch.tensor([p])).logits[0].double(), temperature=t_base)
                         for p in PROMPTS])
    return compute_entropy_stats(ent, torch.ones_like(ent, dtype=torch.bool), 0.8)


def reference_logprobs(model, sample, stats, t_base, tau, mode):
    """Independent computation: teacher-forced transformers logits, our adaptive temperature of
    each position, log_softmax(z / T) of the sampled token. Returns (logprobs, temperatures)."""
    ids = torch.tensor([list(sample.prompt_ids) + list(sample.response_ids)])
    p, r = len(sample.prompt_ids), len(sample.response_ids)
    with torch.no_grad():
        z = model(input_ids=ids).logits[0, p - 1:p - 1 + r].double()
    temps = adaptive_temperature(z, stats, t_base, tau, mode).double() if tau > 0 else torch.full((r,), t_base,
                                                                                                   dtype=torch.float64)
    logp = torch.log_softmax(z / temps.unsqueeze(-1), dim=-1)
    return logp.gather(-1, torch.tensor(sample.response_ids, dtype=torch.long).unsqueeze(-1)).squeeze(-1), temps


@pytest.mark.parametrize("t_base,tau,mode", [(1.0, 0.9, "signed"), (0.7, 0.6, "reference")])
def test_adaptive_temperature_logprobs_match_transformers(real_server, real_api_key, real_model_dir, t_base, tau,
                                                          mode):
    model = peaked_model(real_model_dir)
    eng = make_engine(real_server.url, real_api_key)
    eng.update_weights(iter(model.state_dict().items()))  # known weights, whatever ran before
    stats = model_stats(model, t_base)
    params = SamplingParams(n=4, temperature=t_base, top_p=1.0, top_k=-1, max_new_tokens=12, ignore_eos=True,
                            adaptive=True, entropy_stats=stats, temperature_tau=tau, h_hat_mode=mode)
    samples = [s for group in eng.generate(PROMPTS, params) for s in group]
    got, want, plain, temps = [], [], [], []
    for s in samples:
        ref, t = reference_logprobs(model, s, stats, t_base, tau, mode)
        got.append(torch.tensor(s.rollout_logprobs, dtype=torch.float64))
        want.append(ref)
        plain.append(reference_logprobs(model, s, stats, t_base, 0.0, mode)[0])
        temps.append(t)
    got, want, plain, temps = (torch.cat(x) for x in (got, want, plain, temps))
    assert got.numel() == 12 * 4 * len(PROMPTS)
    assert torch.allclose(got, want, atol=1e-4, rtol=0), float((got - want).abs().max())
    # the comparison can fail: the temperatures really varied and plain T_base log-probs differ
    assert float(temps.max() - temps.min()) > 0.05
    assert float((got - plain).abs().max()) > 1e-2


def test_tau_zero_changes_nothing(real_server, real_api_key, real_model_dir):
    model = peaked_model(real_model_dir)
    eng = make_engine(real_server.url, real_api_key)
    eng.update_weights(iter(model.state_dict().items()))
    stats = model_stats(model, 1.0)
    params = SamplingParams(n=3, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=10, ignore_eos=True,
                            adaptive=True, entropy_stats=stats, temperature_tau=0.0, h_hat_mode="signed")
    assert "custom_logit_processor" in se.generate_payload([PROMPTS[0]], params)  # the processor does run
    samples = [s for group in eng.generate(PROMPTS, params) for s in group]
    got = torch.cat([torch.tensor(s.rollout_logprobs, dtype=torch.float64) for s in samples])
    want = torch.cat([reference_logprobs(model, s, stats, 1.0, 0.0, "signed")[0] for s in samples])
    assert torch.allclose(got, want, atol=1e-4, rtol=0), float((got - want).abs().max())


def _train_and_sync_worker(rank, world, url, api_key, model_dir, sync_dir):
    """2 gloo ranks, TP=2: per mode, train the actor a few steps, stream its HF weights into the
    server the way the trainer does (rank 0's engine consumes the collective export, rank 1
    drains it), then greedy-decode on the server. Rank 0 returns weights and continuations."""
    from transformers import AutoConfig

    from hapo_megatron.config import OptimConfig
    from hapo_megatron.parallel.groups import initialize_parallel
    from hapo_megatron.training.actor import MegatronActor
    from hapo_megatron.training.batches.micro_batches import SequenceData, build_rank_micro_batches
    from hapo_megatron.training.sft import cross_entropy_loss_factory

    g = initialize_parallel(tp=2, seed=3)
    actor = MegatronActor(AutoConfig.from_pretrained(model_dir), groups=g,
                          optim=OptimConfig(lr=3e-2, lr_warmup_steps=0, weight_decay=0.0),
                          total_optimizer_steps=20, init_hf_path=model_dir,
                              dtype='fp32', use_te=None, sequence_parallel=False, recompute_activations=False,
                              use_distributed_optimizer=True, fused_output_layer=False, moe_aux_loss_coef=None)
    out = {}
    for k, mode in enumerate(("tensor", "disk")):
        target = [40 + 3 * k + i for i in range(8)]  # a continuation the trained model should prefer
        seqs = [SequenceData(p, target, index=i) for i, p in enumerate(PROMPTS)]
        mbs = build_rank_micro_batches(seqs, dp_rank=0, dp_size=1, micro_batch_size=4, max_tokens_per_micro_batch=None)
        for _ in range(4):
            actor.train_step(mbs, cross_entropy_loss_factory(g.tp))
        eng = make_engine(url, api_key, weight_sync=mode, model_path=model_dir, disk_sync_dir=sync_dir) \
            if rank == 0 else None
        named, kept = actor.export_hf_weights(), []

        def keep(stream):
            for name, t in stream:  # numpy: tensors through a multiprocessing queue would travel
                kept.append((name, t.detach().numpy().copy()))  # as fds of a process that exits
                yield name, t
        if eng is not None:
            eng.update_weights(keep(named))
        for _ in named:
            pass
        if eng is not None:
            greedy = eng.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=8,
                                                          ignore_eos=True))
            out[mode] = {"weights": kept, "greedy": [grp[0].response_ids.tolist() for grp in greedy]}
    return out


@pytest.mark.slow
def test_megatron_actor_weights_reach_the_server(real_server, real_api_key, real_model_dir, tmp_path):
    from tests.distributed import run_distributed

    r0, _ = run_distributed(_train_and_sync_worker, 2, real_server.url, real_api_key, real_model_dir,
                            str(tmp_path / "sync"), timeout=900)
    initial = hf_model(None, real_model_dir)
    before = hf_greedy(initial, PROMPTS, 8)
    for mode in ("tensor", "disk"):
        trained = hf_model([(n, torch.from_numpy(w)) for n, w in r0[mode]["weights"]], real_model_dir)
        want = hf_greedy(trained, PROMPTS, 8)
        assert want != before, "training did not change the greedy continuations: the check would be vacuous"
        assert r0[mode]["greedy"] == want, mode
    assert r0["tensor"]["greedy"] != r0["disk"]["greedy"]  # the second push really replaced the first


@pytest.mark.slow
def test_killed_server_stops_the_trainer_and_keeps_its_checkpoint(real_server, real_api_key, real_model_dir,
                                                                   tmp_path):
    """The trainer (one process) attached to a real server (the session's: the pool starts it again
    only if a later test needs it); the server is SIGKILLed after checkpoint 2: the run ends with a
    message naming the server, the checkpoint stays loadable, and a fresh engine call fails with a
    clear error instead of hanging.

    The server requires the run's API key, which (as `serve --api-key-file RUN/rollout_api_key`
    leaves it) sits only in the run's owner-only key file: the trainer finds it there by itself,
    and afterwards the key is in no other file of the run or the server log, nor in the output."""
    import os
    import signal
    import stat
    import subprocess
    import sys

    from hapo_megatron.rollout.sglang.api_key import API_KEY_ENV, KEY_FILE_NAME, REDACTED, write_key_file
    from hapo_megatron.rollout.sglang.client import ServerDiedError, SGLangError
    from hapo_megatron.training.checkpointing.checkpoint import find_latest, read_rl_state
    from tests.training.tiny_setup import ROOT, tiny_overrides

    data = os.path.dirname(real_model_dir)
    run_dir = str(tmp_path / "run")
    server, key, key_file = real_server, real_api_key, os.path.join(run_dir, KEY_FILE_NAME)
    write_key_file(key_file, key)
    cmd = [sys.executable, "-m", "hapo_megatron.train", "--config", os.path.join(ROOT, "examples/cpu_tiny/config.yaml"),
           *tiny_overrides(data, run_dir, **{
               "trainer.total_steps": 200, "trainer.save_interval": 1, "trainer.keep_last_k": 5,
               "parallel.tensor_model_parallel_size": 1, "rollout.engine": "sglang",
               "rollout.sglang.server_urls": f"[{server.url}]", "rollout.sglang.max_retries": 1,
               "trainer.val_at_end": "false"})]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    env.pop(API_KEY_ENV, None)  # the key file is the trainer's only source
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        marker = os.path.join(run_dir, "checkpoints", "step_000002", "COMPLETE")
        while not os.path.exists(marker):
            assert proc.poll() is None, f"trainer exited early:\n{proc.stdout.read()[-4000:]}"
            subprocess.run(["sleep", "0.5"])
        os.killpg(server.process.pid, signal.SIGKILL)  # a crash of the whole server process group
        server.process.wait()
        out, _ = proc.communicate(timeout=900)  # a hang here is the failure being tested
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-4000:]
    assert "hapo train: stopped: the SGLang rollout engine failed" in out and server.url in out, out[-4000:]
    latest = find_latest(os.path.join(run_dir, "checkpoints"))
    assert latest is not None and int(read_rl_state(latest)["step"]) >= 2
    dead = sglang_engine(server_urls=[server.url], launch=False, wait_for_servers=False, max_retries=1)
    dead.http.sleep = lambda s: None
    with pytest.raises(ServerDiedError, match=f"no SGLang server left in use after {server.url} failed"):
        dead.generate([[1, 2]], SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=2))
    with pytest.raises(SGLangError, match=f"weight sync: no SGLang server left in use.*{server.url}: lost"):
        dead.update_weights(iter([("x", torch.zeros(1))]))  # it failed during generate: out of use
    # the key: only in the owner-only key file (SGLang did print it: the log has it redacted)
    files = [os.path.join(root, name) for root, _, names in os.walk(tmp_path) for name in names]
    holders = []
    for path in [*files, server.log_path]:  # the run's files and the server's log
        with open(path, "rb") as f:
            if key.encode() in f.read():
                holders.append(path)
    assert holders == [key_file]
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    assert key not in out
    with open(server.log_path) as f:
        assert REDACTED in f.read()
