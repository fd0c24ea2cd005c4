"""A run trained past its base model's context, evaluated through a REAL CPU SGLang server
(docs/evaluation.md, docs/conversion.md): the export of its checkpoint declares the run's
model.max_position_embeddings, the server gets the same --context-length / override hapo eval
gives the servers it launches, and `hapo eval` answers a prompt longer than the base context.

Mutation tried: with the context taken from the base model (max_position_embeddings unset in the
run's config) the export says 256 and the server refuses the prompt ("longer than the model's
context length"), so hapo eval fails.
"""

import json
import os
import subprocess
import sys
import textwrap

from hapo_megatron.config import load_config, save_config
from hapo_megatron.rollout.sglang.api_key import write_key_file
from hapo_megatron.rollout.sglang.launch import stop_process
from hapo_megatron.training.context_length import sglang_context_args
from tests.training.tiny_setup import ROOT

from .real_sglang import start_server

CONTEXT = 1024


def test_eval_answers_past_the_base_context(real_model_dir, real_api_key, tmp_path):
    from transformers import AutoTokenizer

    base = json.load(open(os.path.join(real_model_dir, "config.json")))["max_position_embeddings"]
    run = tmp_path / "run"
    cfg = load_config(None, [f"model.hf_model_path={real_model_dir}", f"model.max_position_embeddings={CONTEXT}"])
    save_config(cfg, str(run / "config.yaml"))
    ckpt, export = run / "checkpoints" / "step_000001" / "model", tmp_path / "export"
    convert = textwrap.dedent(f"""
        import sys
        from hapo_megatron.convert.cli import main
        sys.exit(main(["hf-to-megatron", "--hf-model-path", {real_model_dir!r}, "--megatron-path", {str(ckpt)!r}])
                 or main(["megatron-to-hf", "--megatron-path", {str(ckpt)!r}, "--hf-model-path", {str(export)!r}]))
    """)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", convert], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.load(open(export / "config.json"))["max_position_embeddings"] == CONTEXT

    tokenizer = AutoTokenizer.from_pretrained(str(export))
    question = "Calculate 7 - 0. " * 30 + "End with Answer: <number>."
    assert base < len(tokenizer(question)["input_ids"]) < CONTEXT - 8
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"data_source": "long", "prompt": [{"role": "user", "content": question}],
                                "reward_model": {"ground_truth": "7", "style": "rule"}}) + "\n")
    key_file = tmp_path / "key"
    write_key_file(str(key_file), real_api_key)
    server = start_server(str(export), str(tmp_path / "server.log"), real_api_key,
                          extra_args=tuple(sglang_context_args(cfg, [])))
    try:
        from hapo_megatron.evaluate import main
        rc = main(["--model", str(export), "--data", str(data), "--out", str(tmp_path / "eval.json"),
                   "--sglang-url", server.url, "--api-key-file", str(key_file), "--n", "1", "--max-new-tokens", "4",
                   "--max-prompt-length", str(CONTEXT - 8), "--device", "cpu", "--save-responses"])
    finally:
        stop_process(server)
    log = open(tmp_path / "server.log").read()
    assert rc == 0, log[-3000:]
    assert "before crash diagnostics" not in log  # stopped without SGLang's 5 s wait (launch.server_env)
    result = json.load(open(tmp_path / "eval.json"))
    assert result["num_prompts"] == 1 and len(result["per_prompt"][0]["responses"]) == 1
