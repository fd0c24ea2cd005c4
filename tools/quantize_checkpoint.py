#!/usr/bin/env python
"""Quantise a trained policy with NVIDIA ModelOpt into an HF checkpoint that SGLang serves.

    python tools/quantize_checkpoint.py --model runs/hapo/hf --out runs/hapo/hf-fp8 \
        --qformat fp8 --calib-data data/dapo-math-17k.parquet --calib-size 256
    python -m sglang.launch_server --model-path runs/hapo/hf-fp8 --quantization modelopt_fp8

Post-training quantisation: ModelOpt inserts quantizers into the HF model, calibrates their
scales on a few prompts (a forward pass each), then `export_hf_checkpoint` writes real
low-precision weights plus scales and a `quantization_config` (`quant_method: modelopt`) that
SGLang's `modelopt_fp8` / `modelopt_fp4` loaders read. Formats:

- `fp8`   (default): FP8 E4M3 weights and activations, per-tensor scales (Hopper and newer).
- `nvfp4`: NVFP4 weights and activations, block scales (Blackwell).
`--kv-cache fp8` also quantises the KV cache. `--model` may be an HF directory or a Megatron
checkpoint (converted first, like `hapo eval`; give `--hf-config`). The tokenizer is copied.

Runs on CPU for tiny models (slow for real ones; use a GPU). Needs `pip install nvidia-modelopt`.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import shutil
import sys
import time
from typing import Iterable, Sequence

# Run from a checkout without installing the package: make the repository root importable.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from hapo_megatron.config.base import DTYPES  # noqa: E402 (needs the path above)

# qformat -> (name of the ModelOpt config in modelopt.torch.quantization, SGLang --quantization)
QFORMATS = {
    "fp8": ("FP8_DEFAULT_CFG", "modelopt_fp8"),
    "nvfp4": ("NVFP4_DEFAULT_CFG", "modelopt_fp4"),
}
KV_CACHE_CFGS = {"none": None, "fp8": "FP8_KV_CFG"}

# Used when no --calib-data is given: short math-reasoning texts (the policy's domain).
BUILTIN_CALIBRATION = [
    "Solve for x: 3x + 7 = 22. First subtract 7 from both sides to get 3x = 15, so x = 5.",
    "Compute 48 * 25. Since 25 = 100 / 4, 48 * 25 = 4800 / 4 = 1200. Answer: 1200",
    "Find the sum of the interior angles of a hexagon. The formula is (n - 2) * 180 degrees, "
    "so (6 - 2) * 180 = 720. The answer is \\boxed{720}.",
    "Let f(x) = x^2 - 4x + 3. The roots are x = 1 and x = 3 because f(x) = (x - 1)(x - 3).",
    "How many positive divisors does 36 have? 36 = 2^2 * 3^2, so (2 + 1)(2 + 1) = 9 divisors.",
    "A train travels 180 km in 2.5 hours. Its average speed is 180 / 2.5 = 72 km/h.",
    "What is the probability of rolling a sum of 7 with two fair dice? There are 6 favourable "
    "outcomes out of 36, so the probability is 1/6.",
    "Simplify (a^3 b^2)^2 / (a^2 b). This is a^6 b^4 / (a^2 b) = a^4 b^3.",
]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model dir or Megatron checkpoint/run dir")
    ap.add_argument("--out", required=True, help="output directory of the quantised checkpoint")
    ap.add_argument("--qformat", choices=sorted(QFORMATS), default="fp8")
    ap.add_argument("--kv-cache", choices=sorted(KV_CACHE_CFGS), default="none",
                    help="also quantise the KV cache")
    ap.add_argument("--calib-data", nargs="*", default=[],
                    help="calibration prompts: .parquet/.jsonl prompt files or .txt (one per line)")
    ap.add_argument("--calib-size", type=int, default=128, help="calibration samples")
    ap.add_argument("--calib-seq-len", type=int, default=512, help="max tokens per sample")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--device", default=None, help="default cuda if available, else cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="dtype of the unquantised tensors (default bf16 on GPU, fp32 on CPU)")
    ap.add_argument("--hf-config", default=None, help="HF dir (config+tokenizer) for Megatron input")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return ap


def check_args(args) -> None:
    """Argument checks that need no model (ValueError naming the argument)."""
    if args.calib_size < 1:
        raise ValueError(f"--calib-size must be >= 1, got {args.calib_size}")
    if args.calib_seq_len < 8:
        raise ValueError(f"--calib-seq-len must be >= 8, got {args.calib_seq_len}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if not os.path.exists(args.model):
        raise ValueError(f"--model {args.model!r} does not exist")
    for path in args.calib_data:
        if not os.path.isfile(path):
            raise ValueError(f"--calib-data {path!r} is not a file")
    if os.path.exists(args.out) and os.listdir(args.out) and not args.overwrite:
        raise ValueError(f"--out {args.out!r} exists and is not empty (pass --overwrite)")
    if os.path.abspath(args.out) == os.path.abspath(args.model):
        raise ValueError("--out must differ from --model")


def quant_config(mtq, qformat: str, kv_cache: str = "none") -> dict:
    """The ModelOpt quantisation config for `qformat`, plus KV-cache quantizers if asked.

    ModelOpt >= 0.40 stores `quant_cfg` as a list of rules, older versions as a dict; both work.
    """
    if qformat not in QFORMATS:
        raise ValueError(f"qformat must be one of {sorted(QFORMATS)}, got {qformat!r}")
    if kv_cache not in KV_CACHE_CFGS:
        raise ValueError(f"kv_cache must be one of {sorted(KV_CACHE_CFGS)}, got {kv_cache!r}")
    cfg = copy.deepcopy(getattr(mtq, QFORMATS[qformat][0]))
    if KV_CACHE_CFGS[kv_cache]:
        kv = copy.deepcopy(getattr(mtq, KV_CACHE_CFGS[kv_cache])["quant_cfg"])
        if isinstance(cfg["quant_cfg"], list):
            cfg["quant_cfg"] = cfg["quant_cfg"] + (kv if isinstance(kv, list) else [
                {"quantizer_name": k, "cfg": v} for k, v in kv.items()])
        else:
            cfg["quant_cfg"].update(kv)
    return cfg


def calibration_texts(paths: Sequence[str], tokenizer, limit: int) -> list[str]:
    """Up to `limit` calibration texts: prompt files (chat template applied) or .txt lines."""
    if not paths:
        return (BUILTIN_CALIBRATION * (limit // len(BUILTIN_CALIBRATION) + 1))[:limit]
    from hapo_megatron.data import load_prompt_rows, render_prompt

    texts: list[str] = []
    for path in paths:
        if path.endswith(".txt"):
            with open(path, encoding="utf-8") as f:
                texts.extend(line.strip() for line in f if line.strip())
        else:
            texts.extend(render_prompt(row["prompt"], tokenizer, apply_chat_template=True)[0]
                         for row in load_prompt_rows(path, prompt_key='prompt'))
        if len(texts) >= limit:
            break
    if not texts:
        raise ValueError("--calib-data holds no samples")
    return texts[:limit]


def batches(texts: Sequence[str], tokenizer, batch_size: int, seq_len: int) -> Iterable[dict]:
    """Tokenised, padded batches (`input_ids`, `attention_mask` `[b, <=seq_len]`)."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    for i in range(0, len(texts), batch_size):
        yield tokenizer(list(texts[i:i + batch_size]), return_tensors="pt", padding=True,
                        truncation=True, max_length=seq_len)


def quantize(model, tokenizer, texts: Sequence[str], *, qformat: str = "fp8",
             kv_cache: str = "none", batch_size: int = 4, seq_len: int = 512):
    """Insert ModelOpt quantizers into `model` and calibrate them on `texts` (in place)."""
    import torch
    import modelopt.torch.quantization as mtq

    cfg = quant_config(mtq, qformat, kv_cache)
    device = next(model.parameters()).device
    data = [{k: v.to(device) for k, v in b.items()}
            for b in batches(texts, tokenizer, batch_size, seq_len)]

    def forward_loop(m):
        with torch.no_grad():
            for b in data:
                m(**b)

    return mtq.quantize(model, cfg, forward_loop)


def export(model, tokenizer, out: str, dtype, meta: dict) -> None:
    """Write the quantised HF checkpoint, the tokenizer and `hapo_quantization.json`."""
    from modelopt.torch.export import export_hf_checkpoint

    os.makedirs(out, exist_ok=True)
    export_hf_checkpoint(model, dtype=dtype, export_dir=out)
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, "hapo_quantization.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)


def run(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hapo_megatron.dtypes import torch_dtype
    from hapo_megatron.evaluate import resolve_model

    check_args(args)
    if importlib.util.find_spec("modelopt") is None:
        raise ValueError("nvidia-modelopt is not installed: pip install nvidia-modelopt")
    model_dir, _ = resolve_model(args.model, args.hf_config, None, max_position_embeddings=None)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch_dtype(args.dtype or ("bf16" if device.startswith("cuda") else "fp32"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)  # conversion copies the tokenizer
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    texts = calibration_texts(args.calib_data, tokenizer, args.calib_size)
    t0 = time.perf_counter()
    model = quantize(model, tokenizer, texts, qformat=args.qformat, kv_cache=args.kv_cache,
                     batch_size=args.batch_size, seq_len=args.calib_seq_len)
    if args.overwrite and os.path.isdir(args.out):
        shutil.rmtree(args.out)
    meta = {"source_model": args.model, "qformat": args.qformat, "kv_cache": args.kv_cache,
            "calib_samples": len(texts), "calib_data": list(args.calib_data) or "builtin",
            "calib_seq_len": args.calib_seq_len, "sglang_quantization": QFORMATS[args.qformat][1],
            "calibration_s": time.perf_counter() - t0}
    export(model, tokenizer, args.out, dtype, meta)
    return meta


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        meta = run(args)
    except ValueError as e:
        print(f"quantize_checkpoint: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.qformat} checkpoint to {args.out}\nserve it with:\n  python -m "
          f"sglang.launch_server --model-path {args.out} --quantization "
          f"{meta['sglang_quantization']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
