"""`RLState`: the RL loop's checkpointed state as one typed value, readable from the key layout
checkpoints have always had (and from older ones that lack some keys)."""

import json
from types import SimpleNamespace

import pytest

from hapo_megatron.algo import EntropyStats
from hapo_megatron.data import PromptSampler
from hapo_megatron.training.checkpointing.rl_state import RLState
from hapo_megatron.training.batches.rollout_batch import DynamicSampler, RolloutBatch
from hapo_megatron.training.runtime import Runtime

# rl_state.json as the trainer wrote it before RLState existed (step 3 of a cpu_steps run, the
# dynamic-sampling buffer and scheduler shortened)
OLD_LAYOUT = {
    "step": 3,
    "sampler": {"epoch": 0, "position": 12, "seed": 1, "shuffle": True, "batch_size": 4, "num_prompts": 20},
    "entropy_stats": {"pivot": 0.70297, "std": 2.83286, "pos_max": 0.09517, "neg_min": -1.38542},
    "consecutive_skips": 1,
    "num_skipped_updates": 2,
    "sft_done": True,
    "dynamic_sampling": {"buffer": RolloutBatch(prompt_ids=[[1]], response_ids=[[2, 3]],
                                                rollout_logprobs=[[-1.0, -2.0]], temperatures=[[]],
                                                finish_reasons=["stop"], group_ids=[4], scores=[1.0], accs=[True],
                                                rewards=[1.0], data_sources=["x"]).to_dict(),
                         "num_gen_batches": 2, "num_groups_seen": 32, "num_groups_kept": 13},
    "scheduler": {"max_lr": 0.001, "num_steps": 206},
}


def _state():
    return RLState(sampler=PromptSampler(list(range(20)), 4, seed=9, shuffle=True),
                   dyn=DynamicSampler(enabled=True, max_num_gen_batches=3, metric='acc'))


class _Actor:
    def __init__(self):
        self.state = None

    def train_state_dict(self):
        return {"num_skipped_updates": 5, "scheduler": {"num_steps": 7}}

    def load_train_state_dict(self, state):
        self.state = state

    def save(self, path):
        raise AssertionError("not called here")


def test_old_layout_loads_and_round_trips():
    rl = _state()
    rl.load_state_dict(json.loads(json.dumps(OLD_LAYOUT)))
    assert rl.step == 3 and rl.consecutive_skips == 1 and rl.sft_done
    assert rl.rollout_entropy_stats == EntropyStats.from_dict(OLD_LAYOUT["entropy_stats"])
    assert rl.sampler.position == 12 and rl.sampler.seed == 1
    assert rl.dyn.num_groups_kept == 13 and rl.dyn.buffer.group_ids == [4]
    again = _state()
    again.load_state_dict(json.loads(json.dumps(rl.state_dict())))
    assert again.state_dict() == rl.state_dict()
    actor_keys = {"num_skipped_updates", "scheduler"}
    assert set(rl.state_dict()) | actor_keys == set(OLD_LAYOUT)  # the same file layout
    for key in set(OLD_LAYOUT) - actor_keys:
        assert rl.state_dict()[key] == OLD_LAYOUT[key], key


def test_older_checkpoints_without_newer_keys():
    rl = _state()
    rl.load_state_dict({"step": 2, "sampler": OLD_LAYOUT["sampler"], "entropy_stats": None})
    assert rl.step == 2 and rl.rollout_entropy_stats is None and rl.consecutive_skips == 0
    assert rl.sft_done  # written after the warm start
    assert len(rl.dyn.buffer) == 0
    with pytest.raises(KeyError):
        rl.load_state_dict({"sampler": OLD_LAYOUT["sampler"]})  # no step: not a checkpoint


def test_runtime_writes_and_restores_the_whole_file():
    actor, rl = _Actor(), _state()
    rl.step = 6
    rt = Runtime(cfg=None, groups=None, rank=0, world_size=1, tokenizer=None, hf_config=None, train_ds=None,
                 val_ds=None, actor=actor, engine=None, reward_fn=None, logger=None, ckpt=None, rl=rl)
    state = rt.checkpoint_state()
    assert set(state) == set(OLD_LAYOUT) and state["step"] == 6 and state["num_skipped_updates"] == 5
    rt.restore(OLD_LAYOUT)
    assert rt.start_step == rt.rl.step == 3 and actor.state is OLD_LAYOUT
    saved = []
    rt.ckpt = SimpleNamespace(save=lambda step, rl_state, save_model, rng_state: saved.append((step, rl_state)))
    rt.save_checkpoint()
    (step, written), = saved
    assert step == 3 and "step" not in written and set(written) | {"step"} == set(OLD_LAYOUT)
