"""Parts of the synchronous rollout-manager tests (`test_sync_manager.py`), importable by the
manager process the tests spawn: a seeded engine (what a server with per-row seeds does: the same
request, the same answer), a reward with mixed group accuracies (dynamic sampling then needs
several generation rounds), and the runtime `stages.generate_step` reads."""

from __future__ import annotations

import random
from types import SimpleNamespace

from hapo_megatron.config import load_config
from hapo_megatron.data.sampler import PromptSampler
from hapo_megatron.rewards.scoring import RewardScorer
from hapo_megatron.rollout.engine import RowResult, Sample
from hapo_megatron.training.batches.rollout_batch import DynamicSampler
from hapo_megatron.training.memory.engine_memory import EngineMemory
from hapo_megatron.training.runtime import sampling_seed
from tests.rollout.standin_engine import StandInEngine

OVERRIDES = ["data.train_batch_size=3", "rollout.generate_batch_size=2", "rollout.n=3", "trainer.ppo_mini_batch_size=3",
             "rollout.max_response_length=8", "reward.overlong_buffer_len=4", "algo.filter_groups=true",
             "algo.max_num_gen_batches=8",
             "reward.num_workers=0", "reward.reward_fn=tests.training.asynchronous.sync_manager_parts:score",
             "algo.adaptive_temperature=false", "rollout.engine=sglang", "rollout.sglang.colocate=false"]


def score(solution_str: str, ground_truth: str) -> float:
    """+1 when the response's first word has the parity of the ground truth, else -1."""
    words = solution_str.split()
    return 1.0 if words and int(words[0]) % 2 == int(ground_truth) % 2 else -1.0


class SeededEngine(StandInEngine):
    """Each row's tokens, log-probs and length are a function of (prompt, sampling parameters,
    row): a request sent again anywhere gets the same answer, and any parameter that changes
    (the seed, the entropy statistics of the adaptive temperature, ...) changes it."""

    def generate(self, prompt_ids, params, on_samples=None):
        out = []
        for i, prompt in enumerate(prompt_ids):
            group = []
            for k in range(params.n):
                rng = random.Random(f"{list(prompt)}|{params!r}|{k}")  # str seeds hash the same in every process
                size = rng.randint(1, params.max_new_tokens)
                ids = [rng.randrange(3, 50) for _ in range(size)]
                group.append(Sample(prompt_ids=list(prompt), response_ids=ids,
                                    rollout_logprobs=[-rng.random() for _ in ids], temperatures=[],
                                    finish_reason="length" if size == params.max_new_tokens else "stop",
                                    prompt_index=i, sample_index=k))
            if on_samples is not None:
                on_samples(group)
            out.append(group)
        return out

    def generate_group(self, rows, params):
        """Over-sampling's calls: each row answered whole, as a function of its input and seed."""
        out = []
        for k, row in enumerate(rows):
            rng = random.Random(f"{list(row.input_ids)}|{params!r}|{row.seed}|{row.max_new_tokens}|{k}")
            size = rng.randint(1, row.max_new_tokens)
            ids = tuple(rng.randrange(3, 50) for _ in range(size))
            out.append(RowResult(token_ids=ids, logprobs=tuple(-rng.random() for _ in ids),
                                 finish_reason="length" if size == row.max_new_tokens else "stop"))
        return out


def records(count: int = 24) -> list:
    return [SimpleNamespace(prompt_ids=[1, 2 + p, 7 * p % 11], ground_truth=str(p), data_source="d", extra_info={})
            for p in range(count)]


def make_runtime(overrides=()):
    """The runtime `stages.generate_step` reads (in the trainer's process or the manager's)."""
    cfg = load_config(preset="dapo", overrides=[*OVERRIDES, *overrides])
    sampler = PromptSampler(records(), cfg.rollout.generate_batch_size, seed=cfg.data.seed, shuffle=True)
    sent = []
    rt = SimpleNamespace(
        cfg=cfg, engine=SeededEngine(), memory=EngineMemory(), actor=SimpleNamespace(routing="off"),
        control=SimpleNamespace(send=lambda kind, body: sent.append((kind, body))),
        tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)),
                                  eos_token_id=None),
        scorer=RewardScorer(cfg.reward), train_ds=records(), async_rollout=None, sync_manager=None,
        rl=SimpleNamespace(step=0, sampler=sampler, rollout_entropy_stats=None, partial_rollouts=None,
                           dyn=DynamicSampler(enabled=cfg.algo.filter_groups, metric=cfg.algo.filter_groups_metric,
                                              max_num_gen_batches=cfg.algo.max_num_gen_batches)))
    rt.sampling_seed = lambda step, gen_index: sampling_seed(cfg, step, gen_index)
    rt.sent = sent
    return rt
