"""`hapo eval`: avg@k / pass@k of a checkpoint on parquet/JSONL benchmarks.

    hapo eval --model Qwen2.5-Math-7B-hf --data aime24.parquet math500.parquet --out results.json
    hapo eval --model runs/hapo --hf-config Qwen2.5-Math-7B-hf --data aime24.parquet \
        --engine sglang --out results.json

Sampling comes from `rollout.val_*` of the config (its defaults: 8 samples per question at
temperature 0.5, top-p 0.7, no adaptive temperature), or from a named protocol: `--protocol
hapo-paper` is the HAPO authors' evaluation as their scripts set it (`PROTOCOLS`; docs/evaluation.md,
"Protocols"); an explicit option (`--n`, `--temperature`, ...) overrides either. `--model` is an HF model directory or a
Megatron checkpoint (a run directory, its `checkpoints/` directory, one `step_*` directory or a
`dist_checkpointing` directory): Megatron checkpoints are converted to HF first with
`hapo_megatron.convert` into `--convert-dir` (default: a temporary directory), using the HF
config and tokenizer of `--hf-config` (default: `model.hf_model_path` of the run's saved config).
Prints a table per data source and writes JSON: the metrics, the sampling parameters, and per
prompt the accuracy of each sample (with `--save-responses`, the decoded responses too).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Sequence

from hapo_megatron.refusal import OneLineParser
from hapo_megatron.config.base import DTYPES

logger = logging.getLogger("hapo.eval")

# Named evaluation protocols (docs/evaluation.md, "Protocols"). hapo-paper: the HAPO authors'
# validation settings in starriver030515/HAPO's recipe/qwen2.5_math_{1.5b,7b}.sh (val_kwargs n 8,
# temperature 0.5, top_p 0.7, top_k -1, do_sample; max_prompt_length 1024, max_response_length
# 10240) and scripts/eval_model.sh (temperature 0.5, top_p 0.7, prompt 1024, response 10240); the
# paper reports the mean accuracy over the 8 samples, avg@8 (= unbiased pass@1), here with pass@8.
PROTOCOLS: dict[str, dict] = {
    "hapo-paper": dict(n=8, temperature=0.5, top_p=0.7, top_k=-1, max_new_tokens=10240, max_prompt_length=1024,
                       k=[8]),
}


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="hapo eval", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model dir or Megatron checkpoint/run dir")
    ap.add_argument("--data", nargs="+", required=True, help="benchmark files (.parquet/.jsonl)")
    ap.add_argument("--out", required=True, help="results JSON file")
    ap.add_argument("--config", default=None, help="YAML config (rollout/reward/data sections used)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="dotted config override, e.g. rollout.sglang.server_tp_size=2 (repeat)")
    ap.add_argument("--engine", choices=("hf", "sglang"), default=None,
                    help="rollout engine (default: rollout.engine of the config)")
    ap.add_argument("--sglang-url", action="append", default=[],
                    help="attach to a running SGLang server (repeat for several)")
    ap.add_argument("--api-key-file", default=None,
                    help="file with the attached servers' API key, e.g. a run's rollout_api_key "
                         "(default: $HAPO_ROLLOUT_API_KEY; servers eval launches get a fresh key)")
    ap.add_argument("--protocol", choices=sorted(PROTOCOLS), default=None,
                    help="a named evaluation protocol: its samples per question, temperature, top-p, "
                         "top-k, lengths and k values replace the config's (hapo-paper: the HAPO "
                         "authors' scripts, 8 samples at T 0.5, top-p 0.7, 10240 new tokens, avg@8/pass@8)")
    ap.add_argument("--n", type=int, default=None, help="samples per prompt (default: protocol, else val_n)")
    ap.add_argument("--temperature", type=float, default=None,
                    help="default: protocol, else val_temperature")
    ap.add_argument("--top-p", type=float, default=None, help="default: protocol, else val_top_p")
    ap.add_argument("--top-k", type=int, default=None, help="default: protocol, else -1 (off)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="default: protocol, else rollout.max_response_length")
    ap.add_argument("--k", type=int, nargs="+", default=None,
                    help="k values of avg@k/pass@k (default: protocol, else powers of two up to n)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=None, help="prompts per generate call")
    ap.add_argument("--limit", type=int, default=None, help="evaluate only the first N prompts")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the model's)")
    ap.add_argument("--hf-config", default=None,
                    help="HF model dir giving config + tokenizer for a Megatron checkpoint")
    ap.add_argument("--convert-dir", default=None, help="where a Megatron checkpoint is converted")
    ap.add_argument("--device", default=None, help="HF engine device (default cuda if available)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="model dtype (default bf16 on GPU, fp32 on CPU)")
    ap.add_argument("--reward", default=None, help="reward name or dotted path (default math)")
    ap.add_argument("--prompt-key", default=None)
    ap.add_argument("--max-prompt-length", type=int, default=None,
                    help="default: protocol, else data.max_prompt_length")
    ap.add_argument("--no-chat-template", action="store_true")
    ap.add_argument("--save-responses", action="store_true", help="keep decoded responses in JSON")
    return ap


# ---------------------------------------------------------------------- model resolution
def is_hf_model_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def find_megatron_checkpoint(path: str) -> str:
    """The `dist_checkpointing` directory of a run dir / checkpoints dir / step dir / itself."""
    from hapo_megatron.training.checkpointing.checkpoint import find_latest

    for root in (os.path.join(path, "checkpoints"), path):
        if os.path.isfile(os.path.join(root, "latest")) or os.path.isdir(root):
            latest = find_latest(root) if os.path.isdir(root) else None
            if latest:
                path = latest
                break
    for cand in (os.path.join(path, "model"), path):
        if os.path.isfile(os.path.join(cand, "metadata.json")):
            return cand
    raise ValueError(f"--model {path!r} is neither an HF model directory (no config.json) nor a "
                     "Megatron checkpoint (no metadata.json under it or under checkpoints/latest)")


def _hf_config_from_run(path: str) -> str | None:
    """`model.hf_model_path` of a run's saved config, searching upwards from `path`."""
    from hapo_megatron.config import load_config
    from hapo_megatron.config.run_identity import find_run_config

    found = find_run_config(path)
    return load_config(found).model.hf_model_path if found else None


def convert_megatron_checkpoint(ckpt: str, hf_config: str | None, out_dir: str,
                                max_position_embeddings: int | None) -> str:
    """Convert a Megatron checkpoint to an HF directory with `hapo convert megatron-to-hf`.

    `hf_config` (an HF model dir) is needed only when the checkpoint lacks its `hf/` subdir;
    `max_position_embeddings` goes into the export's config.json (the converter also reads it
    from the run's saved config by itself).
    """
    from hapo_megatron.convert.cli import main as convert_main

    argv = ["megatron-to-hf", "--megatron-path", ckpt, "--hf-model-path", out_dir, "--overwrite"]
    if hf_config:
        argv += ["--hf-config-path", hf_config]
    if max_position_embeddings:
        argv += ["--max-position-embeddings", str(int(max_position_embeddings))]
    rc = convert_main(argv)
    if rc not in (0, None):
        raise ValueError(f"conversion of {ckpt} to HF failed (exit status {rc}, see above)")
    return out_dir


def resolve_model(model: str, hf_config: str | None, convert_dir: str | None,
                  max_position_embeddings: int | None) -> tuple[str, str]:
    """(HF model dir to load, source description). Converts Megatron checkpoints (with the
    context ``max_position_embeddings`` in the export's config.json when given)."""
    if not os.path.exists(model):
        raise ValueError(f"--model {model!r} does not exist")
    if is_hf_model_dir(model):
        return model, "hf"
    ckpt = find_megatron_checkpoint(model)
    if not is_hf_model_dir(os.path.join(ckpt, "hf")):
        hf_config = hf_config or _hf_config_from_run(model)
        if not hf_config:
            raise ValueError(f"--model {model!r} is a Megatron checkpoint without an hf/ config: "
                             "pass --hf-config with the HF model directory it was trained from")
    out = convert_dir
    if out is None:
        raise ValueError("resolve_model: a Megatron checkpoint needs a convert_dir (run() passes a temporary one)")
    logger.info("converting Megatron checkpoint %s to HF in %s", ckpt, out)
    return convert_megatron_checkpoint(ckpt, hf_config, out, max_position_embeddings), f"megatron:{ckpt}"


# ---------------------------------------------------------------------- main
class _Subset:
    """The first `limit` records of a dataset (keeps its tokenizer)."""

    def __init__(self, dataset, limit: int):
        self.dataset, self.limit = dataset, min(limit, len(dataset))
        self.tokenizer = getattr(dataset, "tokenizer", None)

    def __len__(self):
        return self.limit

    def __getitem__(self, i):
        if not 0 <= i < self.limit:
            raise IndexError(i)
        return self.dataset[i]


def _progress(done: int, total: int) -> None:
    print(f"\r[hapo eval] {done}/{total} prompts", end="" if done < total else "\n",
          file=sys.stderr, flush=True)


def _resolve_settings(args, cfg):
    """Fill unset command-line values from the config (validation sampling = paper protocol)."""
    ro = cfg.rollout
    if args.engine:
        ro = dataclasses.replace(ro, engine=args.engine)
    if args.sglang_url:
        ro = dataclasses.replace(ro, engine=args.engine or "sglang", sglang=dataclasses.replace(
            ro.sglang, server_urls=list(args.sglang_url)))
    import torch

    from hapo_megatron.dtypes import torch_dtype

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = args.dtype or ("bf16" if str(device).startswith("cuda") else "fp32")
    return ro, device, torch_dtype(dtype_name)


def sampling_settings(args, rollout_cfg, data_cfg) -> dict:
    """n, temperature, top_p, top_k, max_new_tokens, max_prompt_length and k of the evaluation:
    each from its command-line option when given, else from ``--protocol`` (`PROTOCOLS`), else
    from the config's validation sampling (``rollout.val_*``, ``rollout.max_response_length``,
    ``data.max_prompt_length``; top-k off, k: powers of two up to n)."""
    proto = PROTOCOLS[args.protocol] if args.protocol else {}
    config = dict(n=rollout_cfg.val_n, temperature=rollout_cfg.val_temperature, top_p=rollout_cfg.val_top_p,
                  top_k=-1, max_new_tokens=rollout_cfg.max_response_length,
                  max_prompt_length=data_cfg.max_prompt_length, k=None)
    given = dict(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                 max_new_tokens=args.max_new_tokens, max_prompt_length=args.max_prompt_length, k=args.k)
    return {name: given[name] if given[name] is not None else proto.get(name, config[name]) for name in config}


def eval_context_length(cfg, model: str) -> int | None:
    """The context the evaluated model was trained with: ``model.max_position_embeddings`` of
    ``--config`` / ``--set`` when set, else, for a Megatron checkpoint, of the saved config of the
    run it belongs to (docs/evaluation.md). None: the model's config.json decides (an export
    declares its run's context)."""
    from hapo_megatron.config.run_identity import run_context_length

    if cfg.model.max_position_embeddings is not None:
        return int(cfg.model.max_position_embeddings)
    if os.path.exists(model) and not is_hf_model_dir(model):
        return run_context_length(model)
    return None


def run(args) -> dict:
    """Evaluate as described by parsed `args`; returns the JSON-ready results. A Megatron
    checkpoint is converted into ``--convert-dir``, else into a temporary ``hapo_eval_hf_*``
    directory that is removed when the evaluation ends, whether it succeeded or failed."""
    if args.convert_dir:
        return _run(args, args.convert_dir)
    with _sigterm_exits(), tempfile.TemporaryDirectory(prefix="hapo_eval_hf_") as scratch:
        return _run(args, os.path.join(scratch, "hf"))


@contextlib.contextmanager
def _sigterm_exits():
    """SIGTERM raises SystemExit(143) while the body runs (main thread only): the default action
    would end the process at once, leaving the temporary conversion behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_now(signum, frame):
        raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args, convert_dir: str) -> dict:
    from transformers import AutoTokenizer

    from hapo_megatron.config import load_config
    from hapo_megatron.data import PromptDataset
    from hapo_megatron.rewards import get_reward_fn
    from hapo_megatron.rollout.engine import SamplingParams
    from hapo_megatron.rollout.factory import make_engine
    from hapo_megatron.training.context_length import sglang_context_args
    from hapo_megatron.training.benchmark_accuracy import aggregate_results, generate_and_score

    cfg = load_config(args.config, args.overrides)
    rollout_cfg, device, dtype = _resolve_settings(args, cfg)
    settings = sampling_settings(args, rollout_cfg, cfg.data)
    context = eval_context_length(cfg, args.model)
    if context is not None and rollout_cfg.engine == "sglang" and not rollout_cfg.sglang.server_urls:
        # launched servers get --context-length (training/context_length.py)
        cfg.model.max_position_embeddings = context
        rollout_cfg = dataclasses.replace(rollout_cfg, sglang=dataclasses.replace(
            rollout_cfg.sglang, extra_server_args=sglang_context_args(cfg, rollout_cfg.sglang.extra_server_args)))
    model_dir, source = resolve_model(args.model, args.hf_config, convert_dir, context)
    # A converted checkpoint carries its tokenizer files (copied from its hf/ or --hf-config).
    tok_path = args.tokenizer or cfg.data.tokenizer_path or model_dir
    tokenizer = AutoTokenizer.from_pretrained(tok_path)
    dataset = PromptDataset(args.data, tokenizer, prompt_key=args.prompt_key or cfg.data.prompt_key,
                            max_prompt_length=settings["max_prompt_length"],
                            apply_chat_template=cfg.data.apply_chat_template and not args.no_chat_template)
    dataset.tokenizer = tokenizer
    data = _Subset(dataset, args.limit) if args.limit else dataset
    sampling = SamplingParams(n=settings["n"], temperature=settings["temperature"], top_p=settings["top_p"],
                              top_k=settings["top_k"], max_new_tokens=settings["max_new_tokens"], seed=args.seed,
                              adaptive=False)
    reward_fn = get_reward_fn(args.reward or cfg.reward.reward_fn)
    reward_kwargs = {"score_format": cfg.reward.score_format, **cfg.reward.reward_kwargs}
    keys = {"key_file": args.api_key_file} if rollout_cfg.engine == "sglang" and args.api_key_file else {}
    engine = make_engine(rollout_cfg, hf_config_or_path=model_dir, tokenizer=tokenizer,
                         device=device, dtype=dtype, **keys)
    t0 = time.perf_counter()
    try:
        results = generate_and_score(engine, data, reward_fn, sampling, tokenizer=tokenizer,
                                     batch_size=args.batch_size, keep_text=args.save_responses,
                                     progress=_progress, reward_kwargs=reward_kwargs)
    finally:
        engine.shutdown()
    metrics = aggregate_results(results, settings["k"])
    per_prompt = [r.to_dict() for r in results]
    if not args.save_responses:
        for r in per_prompt:
            r.pop("responses", None)
    params = dataclasses.asdict(sampling)
    return {"model": args.model, "model_source": source, "hf_model_dir": model_dir,
            "data": list(args.data), "engine": rollout_cfg.engine, "protocol": args.protocol, "sampling": params,
            "max_prompt_length": settings["max_prompt_length"], "k_values": settings["k"],
            "num_prompts": len(data), "elapsed_s": time.perf_counter() - t0,
            "metrics": metrics, "per_prompt": per_prompt}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from hapo_megatron.training.benchmark_accuracy import format_results_table

    try:
        result = run(args)
    except ValueError as e:
        print(f"hapo eval: error: {e}", file=sys.stderr)
        return 2
    print(format_results_table(result["metrics"]))
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2, default=str)
    print(f"[hapo eval] wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
