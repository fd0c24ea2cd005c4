"""`hapo convert` / tools: refusals in-process, and the README walk-through end to end
(tiny model -> torch_dist at TP2 under torchrun -> HF at TP1 -> check)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from hapo_megatron.convert import load_hf_state_dict, save_hf_checkpoint
from hapo_megatron.convert.cli import main
from tests.convert.dist_checks import hf_state, random_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    cfg, model = random_hf_model("llama")
    path = str(tmp_path_factory.mktemp("hf") / "llama")
    save_hf_checkpoint(hf_state(cfg, model).items(), path, cfg)
    return path, cfg, model


def test_refuses_unsupported_architecture(tmp_path, capsys):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path / "gpt2")
    rc = main(["hf-to-megatron", "--hf-model-path", str(tmp_path / "gpt2"), "--megatron-path", str(tmp_path / "out")])
    assert rc == 1 and "unsupported architecture model_type='gpt2'" in capsys.readouterr().err


def test_refuses_mismatched_weights_and_lists_them(tiny_llama, tmp_path, capsys):
    path, cfg, model = tiny_llama
    state = dict(hf_state(cfg, model))
    state.pop("model.norm.weight")
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 64)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)  # old checkpoints: ignored
    state["model.extra.weight"] = torch.zeros(2)
    save_hf_checkpoint(state.items(), str(tmp_path / "bad"), cfg)
    rc = main(["hf-to-megatron", "--hf-model-path", str(tmp_path / "bad"), "--megatron-path", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 1 and not os.path.exists(tmp_path / "o")
    for part in ("missing tensors (1)", "model.norm.weight", "unexpected tensors (1)", "model.extra.weight",
                 "wrong shapes (1)", "down_proj.weight: checkpoint (64, 64) vs config (64, 128)"):
        assert part in err, err


def test_refuses_existing_output_and_wrong_world_size(tiny_llama, tmp_path, capsys):
    path, _, _ = tiny_llama
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    assert main(["hf-to-megatron", "--hf-model-path", path, "--megatron-path", str(tmp_path / "out")]) == 1
    assert "pass --overwrite" in capsys.readouterr().err and (tmp_path / "out" / "keep.txt").exists()
    assert main(["hf-to-megatron", "--hf-model-path", path, "--megatron-path", str(tmp_path / "o2"), "--tp", "2"]) == 1
    assert "torchrun --nproc-per-node 2" in capsys.readouterr().err
    assert main(["megatron-to-hf", "--hf-model-path", str(tmp_path / "o3"),
                 "--megatron-path", str(tmp_path / "none")]) == 1
    assert "is not a directory" in capsys.readouterr().err


def _run(args, nproc=None):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc \
        else [sys.executable]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(launcher + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def test_tools_end_to_end(tiny_llama, tmp_path):
    """TP2 save under torchrun with the tools/ wrapper, then megatron-to-hf (TP1, resharded) and check in
    one more process (each launch re-imports Megatron, so the two single-process commands share one)."""
    from transformers import AutoModelForCausalLM

    path, cfg, model = tiny_llama
    mcore, back = str(tmp_path / "mcore"), str(tmp_path / "back")
    _run(["tools/convert_hf_to_megatron.py", "--hf-model-path", path, "--megatron-path", mcore, "--tp", "2"], nproc=2)
    assert json.load(open(os.path.join(mcore, "hapo_model.json")))["tp"] == 2
    to_hf = ["megatron-to-hf", "--megatron-path", mcore, "--hf-model-path", back, "--max-shard-size-gb", "0.0001"]
    check = ["check", "--hf-model-path", back, "--megatron-path", mcore, "--tolerance", "1e-4"]
    out = _run(["-c", "import sys; from hapo_megatron.convert.cli import main; "
                f"sys.exit(main({to_hf!r}) or main({check!r}))"])
    assert "max |logit diff|" in out
    ref, got = hf_state(cfg, model), load_hf_state_dict(back)
    assert set(got) == set(ref) and all(torch.equal(got[n], ref[n]) for n in ref)
    index = json.load(open(os.path.join(back, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    reloaded = AutoModelForCausalLM.from_pretrained(back).eval()
    ids = torch.arange(12).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_moe_tools_end_to_end(tmp_path):
    """`tiny-model --arch qwen3_moe`, hf-to-megatron at --tp 2 --ep 2 --etp 1 (2 ranks), then
    megatron-to-hf at --ep 2 alone and check at --tp 2 --ep 2 --etp 1 (2 ranks, one launch): the
    round trip is bit-exact and the logits within 1e-4 of transformers'."""
    from hapo_megatron.models import tiny_hf_config

    hf, mcore, back = str(tmp_path / "hf"), str(tmp_path / "mcore"), str(tmp_path / "back")
    assert main(["tiny-model", "--arch", "qwen3_moe", "--out", hf, "--seed", "3"]) == 0
    _run(["tools/convert_hf_to_megatron.py", "--hf-model-path", hf, "--megatron-path", mcore, "--tp", "2",
          "--ep", "2", "--etp", "1"], nproc=2)
    meta = json.load(open(os.path.join(mcore, "hapo_model.json")))
    assert (meta["tp"], meta["ep"], meta["etp"], meta["arch"]) == (2, 2, 1, "qwen3_moe")
    to_hf = ["megatron-to-hf", "--megatron-path", mcore, "--hf-model-path", back, "--ep", "2"]
    check = ["check", "--hf-model-path", back, "--megatron-path", mcore, "--tp", "2", "--ep", "2", "--etp", "1",
             "--tolerance", "1e-4"]
    # One process group for both commands (torchrun's store does not take a second init).
    out = _run(["--no-python", sys.executable, "-c", "import sys, torch.distributed as dist; "
                "from hapo_megatron.convert.cli import main; dist.init_process_group('gloo'); "
                f"sys.exit(main({to_hf!r}) or main({check!r}))"], nproc=2)
    assert "max |logit diff|" in out
    ref, got = load_hf_state_dict(hf), load_hf_state_dict(back)
    assert any(".mlp.experts.3.up_proj.weight" in n for n in ref)
    assert set(got) == set(ref) and all(torch.equal(got[n], ref[n]) for n in ref)
    assert tiny_hf_config("qwen3_moe").num_experts == 4


def test_expert_layout_needs_its_rank_count(tiny_llama, tmp_path, capsys):
    path, _, _ = tiny_llama
    assert main(["hf-to-megatron", "--hf-model-path", path, "--megatron-path", str(tmp_path / "o"), "--ep", "2"]) == 1
    assert "needs exactly 2 ranks" in capsys.readouterr().err
