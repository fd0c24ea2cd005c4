"""Bad input fails with a clear message before any work (no run directory, no process group)."""

import json
import os
import re

import pytest

from hapo_megatron.train import main
from tests.training.tiny_setup import ROOT, tiny_overrides

CONFIG = os.path.join(ROOT, "examples", "cpu_tiny", "config.yaml")


def torch_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _fails(capsys, tiny, run_dir, *extra, match):
    rc = main(["--config", CONFIG, *tiny_overrides(tiny, str(run_dir), **{"parallel.tensor_model_parallel_size": 1}),
               *extra])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "hapo train: error:" in err and match in err, err
    assert not os.path.exists(run_dir), "work started before the error"
    return err


def test_malformed_dataset_row(tiny, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    rows = [json.loads(line) for line in open(os.path.join(tiny, "train.jsonl"))][:20]
    del rows[7]["reward_model"]
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    err = _fails(capsys, tiny, tmp_path / "run", f"data.train_files=[{bad}]", match="bad.jsonl")
    assert "7" in err and "reward_model" in err


def test_prompt_longer_than_limit(tiny, tmp_path, capsys):
    _fails(capsys, tiny, tmp_path / "run", "data.max_prompt_length=10", match="max_prompt_length")


def test_tp_not_dividing_heads(tiny, tmp_path, capsys):
    _fails(capsys, tiny, tmp_path / "run", "parallel.tensor_model_parallel_size=3",
           match="parallel.tensor_model_parallel_size=3 must divide the model's num_attention_heads")


def test_missing_checkpoint_path(tiny, tmp_path, capsys):
    _fails(capsys, tiny, tmp_path / "run", "--resume", str(tmp_path / "no_such_ckpt"), match="no_such_ckpt")


def test_missing_model_path(tiny, tmp_path, capsys):
    _fails(capsys, tiny, tmp_path / "run", f"model.hf_model_path={tmp_path}/nope", match="does not exist")


def test_config_that_cannot_learn_is_refused(tiny, tmp_path, capsys):
    """rollout.n=1: every group-relative advantage is 0 (the run would complete and learn nothing)."""
    _fails(capsys, tiny, tmp_path / "run", "rollout.n=1", match="nothing is learned; use rollout.n >= 2")


def test_logging_sink_that_is_not_installed_is_refused(tiny, tmp_path, capsys, monkeypatch):
    """logging.wandb=true without wandb stops at start naming the extra, before the model is read
    (mutation: without check_installs in train.preflight the run starts and fails at its first
    log line, after the model download and tokenization)."""
    import hapo_megatron.train as train
    real = train._import_error
    monkeypatch.setattr(train, "_import_error", lambda m: "ModuleNotFoundError: no wandb" if m == "wandb" else real(m))
    _fails(capsys, tiny, tmp_path / "run2", "logging.wandb=true", f"model.hf_model_path={tmp_path}/nope",
           match="logging.wandb=true")  # before the model path is even looked at
    err = _fails(capsys, tiny, tmp_path / "run", "logging.wandb=true", match="logging.wandb=true but wandb")
    assert "pip install -e '.[wandb]'" in err


def test_context_parallel_on_cuda_needs_transformer_engine(monkeypatch):
    import pytest

    import hapo_megatron.train as train
    from hapo_megatron.config import HapoConfig
    cfg = HapoConfig.from_dict({"parallel": {"context_parallel_size": 2}})
    monkeypatch.setattr(train, "_import_error", lambda m: "ModuleNotFoundError: No module named 'transformer_engine'")
    with pytest.raises(ValueError, match="context_parallel_size=2 needs Transformer Engine.*transformer_engine"):
        train.check_installs(cfg, cuda=True)
    train.check_installs(cfg, cuda=False)  # CPU: the tests exercise CP at the loss level
    monkeypatch.setattr(train, "_import_error", lambda m: None)
    train.check_installs(cfg, cuda=True)
    cfg.model.use_te = False
    with pytest.raises(ValueError, match="model.use_te=false"):
        train.check_installs(cfg, cuda=True)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """A tiny random Qwen3-MoE model of 4 experts (with its tokenizer) on disk."""
    from hapo_megatron.models.hf_config import write_tiny_char_model
    path = str(tmp_path_factory.mktemp("moe"))
    write_tiny_char_model(path, "qwen3_moe", seed=0, num_experts=4, num_experts_per_tok=2)
    return path


@pytest.mark.parametrize("world,layout,match", [
    (4, {"parallel.expert_model_parallel_size": 3},
     "parallel.expert_model_parallel_size=3 must divide the model's num_experts=4"),
    # EP 4 divides the 4 experts, but the expert grid ETP x EP x PP = 2 x 4 x 1 does not divide 4 ranks
    (4, {"parallel.expert_model_parallel_size": 4, "parallel.expert_tensor_parallel_size": 2},
     "not divisible by the expert grid parallel.expert_tensor_parallel_size * expert_model_parallel_size"),
])
def test_bad_expert_layout_fails_before_any_process_group(tiny, tiny_moe, tmp_path, capsys, monkeypatch,
                                                          world, layout, match):
    import torch.distributed as dist

    def no_group(*args, **kwargs):
        raise AssertionError("init_process_group called before the layout was checked")

    monkeypatch.setattr(dist, "init_process_group", no_group)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    run_dir = tmp_path / "run"
    extra = {"model.hf_model_path": tiny_moe, "data.tokenizer_path": tiny_moe, "parallel.tensor_model_parallel_size": 1,
             **layout}
    rc = main(["--config", CONFIG, *tiny_overrides(tiny, str(run_dir), **extra)])
    err = capsys.readouterr().err
    assert rc == 2 and "hapo train: error:" in err and match in err, err
    assert not dist.is_initialized() and not os.path.exists(run_dir)


def test_cpu_threads_leave_a_core_to_asynchronous_rollouts():
    from hapo_megatron.train import cpu_threads
    assert [cpu_threads(2, 1, 0), cpu_threads(2, 1, 1), cpu_threads(2, 2, 0), cpu_threads(2, 2, 1)] == [2, 1, 1, 1]
    assert [cpu_threads(16, 2, 0), cpu_threads(16, 2, 2), cpu_threads(1, 1, 1)] == [8, 7, 1]


def test_fp8_servers_on_a_cpu_machine_are_refused_before_any_process_group(tiny, tmp_path, capsys):
    """rollout.quantization=fp8 with servers the trainer would launch on this CPU machine: the
    preflight (`validate_run`) refuses it in one line, before any process group exists
    (mutation: without `_check_launched_servers` in validate_run the run starts, and the refusal
    came from every launching rank as a traceback once its servers started)."""
    import torch.distributed as dist

    from hapo_megatron.config.validate import CPU_FP8_REFUSED
    if torch_cuda():
        pytest.skip("a CUDA machine launches FP8 servers")
    err = _fails(capsys, tiny, tmp_path / "run", "rollout.engine=sglang", "rollout.quantization=fp8",
                 "rollout.dtype=bf16", match=CPU_FP8_REFUSED)
    assert "Traceback" not in err and not dist.is_initialized()
    assert err.strip().count("\n") == 0, err  # one line


def test_validate_run_decides_the_fp8_hardware_rules():
    """The rules themselves, on any machine (``cuda`` given): CPU servers refused, CUDA servers
    need bf16/fp16, attached servers (server_urls) decide for themselves."""
    from hapo_megatron.config import load_config
    from hapo_megatron.config.validate import CPU_FP8_REFUSED, ModelSpec, validate_run
    from hapo_megatron.models import tiny_hf_config

    spec = ModelSpec.of(tiny_hf_config("qwen3"))

    def run(*overrides, cuda):
        cfg = load_config(CONFIG, ["parallel.tensor_model_parallel_size=1", "rollout.engine=sglang", *overrides])
        return validate_run(cfg, spec, 1, cuda=cuda)

    with pytest.raises(ValueError, match=re.escape(CPU_FP8_REFUSED)):
        run("rollout.quantization=fp8", "rollout.dtype=bf16", cuda=False)
    with pytest.raises(ValueError, match="bf16 or fp16, not fp32"):
        run("rollout.quantization=fp8", "rollout.dtype=fp32", cuda=True)
    assert run("rollout.quantization=fp8", "rollout.dtype=bf16", cuda=True) == 1
    assert run("rollout.quantization=fp8", "rollout.dtype=bf16", "rollout.sglang.server_urls=[http://h:1]",
               cuda=False) == 1
    assert run(cuda=False) == 1
