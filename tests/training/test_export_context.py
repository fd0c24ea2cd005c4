"""`hapo convert` on a trained run's checkpoint (docs/conversion.md): the export declares the run's
context (model.max_position_embeddings from the run's saved config.yaml), and a hub name given
for the HF side resolves to its local snapshot, tokenizer included, or stops with a message
(offline, with a local HF cache laid out as tests/training/test_hub_model.py does)."""

import json
import os
import subprocess
import sys
import textwrap

from hapo_megatron.config import load_config, save_config
from tests.training.test_hub_model import REPO, _offline_hub_cache
from tests.training.tiny_setup import ROOT, tiny_overrides

CONFIG = os.path.join(ROOT, "examples", "cpu_tiny", "config.yaml")


def test_export_takes_the_run_context_and_hub_tokenizer(tiny, tmp_path):
    """Mutations tried: without run_context_length in convert/cli._megatron_side the export says
    256 (the model's own context); without resolve_model_path there, the hub-named export has
    no tokenizer files (AutoConfig alone finds the cached config)."""
    hf_home = str(tmp_path / "hf_home")
    _offline_hub_cache(hf_home, os.path.join(tiny, "model"))
    run = tmp_path / "run"
    cfg = load_config(CONFIG, tiny_overrides(tiny, str(run), **{"model.max_position_embeddings": 512}))
    save_config(cfg, str(run / "config.yaml"))
    ckpt = run / "checkpoints" / "step_000001" / "model"
    script = textwrap.dedent(f"""
        import json, sys
        from hapo_megatron.convert.cli import main
        codes = [main(["hf-to-megatron", "--hf-model-path", {REPO!r}, "--megatron-path", {str(ckpt)!r}]),
                 main(["megatron-to-hf", "--megatron-path", {str(ckpt)!r}, "--hf-model-path", {str(tmp_path / "a")!r}]),
                 main(["megatron-to-hf", "--megatron-path", {str(ckpt)!r}, "--hf-model-path", {str(tmp_path / "b")!r},
                       "--hf-config-path", {REPO!r}, "--max-position-embeddings", "1024"]),
                 main(["megatron-to-hf", "--megatron-path", {str(ckpt)!r}, "--hf-model-path", {str(tmp_path / "c")!r},
                       "--hf-config-path", "tiny-org/not-cached"])]
        print("CODES", json.dumps(codes))
    """)
    env = {**os.environ, "HF_HOME": hf_home, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    codes = json.loads(out.split("CODES", 1)[1].splitlines()[0]) if "CODES" in out else out[-4000:]
    assert codes == [0, 0, 0, 1], codes
    base = json.load(open(os.path.join(tiny, "model", "config.json")))["max_position_embeddings"]
    assert base == 256
    assert json.load(open(tmp_path / "a" / "config.json"))["max_position_embeddings"] == 512  # the run's
    assert "max_position_embeddings=512 from the run's saved config" in out
    assert json.load(open(tmp_path / "b" / "config.json"))["max_position_embeddings"] == 1024  # the flag wins
    for export in ("a", "b"):
        assert (tmp_path / export / "tokenizer_config.json").is_file(), sorted(os.listdir(tmp_path / export))
    assert "--hf-config-path: 'tiny-org/not-cached' is not a local directory and is not in the HF cache" in out
