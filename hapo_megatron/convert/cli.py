"""`hapo convert` and tools/convert_*.py, tools/check_conversion.py.

    hapo convert hf-to-megatron --hf-model-path HF --megatron-path OUT [--tp N] [--pp N] [--ep N] [--etp N]
        [--dtype bf16] [--overwrite]
    hapo convert megatron-to-hf --megatron-path CKPT --hf-model-path OUT [--dtype bf16] [--overwrite]
        [--lora-format merged|peft] [--lora-base HF]   (a LoRA run's checkpoint: docs/lora.md)
    hapo convert check --hf-model-path HF --megatron-path CKPT [--prompt TEXT] [--tolerance X]
    hapo convert tiny-model --arch llama|qwen2|qwen3|qwen3_moe --out DIR [--seed S] [--tokenizer DIR]

TP/PP > 1 run under `torchrun --nproc-per-node TP*PP` (one rank per model shard). MoE models
(Qwen3-MoE) also split experts over --ep ranks and each expert's FFN over --etp (default: --tp);
they need PP * lcm(TP, EP*ETP) ranks (e.g. --tp 2 --ep 2 --etp 1: 2 ranks). A torch_dist
checkpoint loads at any TP/PP/EP/ETP, so megatron-to-hf and check may use other sizes than the save.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

import torch

from hapo_megatron.dtypes import TORCH_DTYPES, short_name, torch_dtype
from hapo_megatron.refusal import OneLineParser
from hapo_megatron.models.hf_config import SUPPORTED_ARCHS

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. 12 + 30 = 42."


class ConversionError(Exception):
    """A user-facing refusal: printed without a traceback, exit status 1."""


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _log(msg: str) -> None:
    if _rank() == 0:
        print(msg, flush=True)


def _check_output_dir(path: str, overwrite: bool) -> None:
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)) and not overwrite:
        raise ConversionError(f"output directory {path!r} exists and is not empty; pass --overwrite to replace it")


def _hf_dtype(hf_config) -> torch.dtype:
    """The dtype recorded in an HF config (fp32 when absent)."""
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if value in TORCH_DTYPES.values() else torch.float32


_OWNED: list[str] = []  # what _init set up and _finish must tear down (not a caller's groups)


def _world_needed(tp: int, pp: int, ep: int, etp: int) -> int:
    """Ranks of a conversion: one per model shard, PP * lcm(TP, EP * ETP) (dense weights are
    replicated over the extra ranks an expert layout needs)."""
    import math

    return pp * math.lcm(tp, ep * etp)


def _init(tp: int, pp: int, ep: int = 1, etp: int | None = None):
    """Join torchrun's process group (or a 1-process one) and initialise TP x PP (x EP x ETP)."""
    import torch.distributed as dist

    etp = tp if etp is None else etp
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    need = _world_needed(tp, pp, ep, etp)
    if world != need:
        raise ConversionError(f"--tp {tp} --pp {pp} --ep {ep} --etp {etp} needs exactly {need} ranks, got "
                              f"WORLD_SIZE={world}: run under `torchrun --nproc-per-node {need} ...`")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from hapo_megatron.compat import activate_cpu_shims
    from hapo_megatron.parallel.groups import initialize_parallel, parallel_initialized

    activate_cpu_shims()  # megatron-core on CPU (gloo); a no-op where CUDA is available
    _OWNED.clear()
    if not dist.is_initialized():
        _OWNED.append("process_group")
    if not parallel_initialized():
        _OWNED.append("model_parallel")
    return initialize_parallel(tp=tp, pp=pp, ep=ep, etp=etp)


def _finish() -> None:
    import torch.distributed as dist

    from hapo_megatron.parallel.groups import destroy_parallel

    if "model_parallel" in _OWNED:
        destroy_parallel()
    if "process_group" in _OWNED and dist.is_initialized():
        dist.destroy_process_group()
    _OWNED.clear()


def _build(hf_config, dtype: torch.dtype, parallel_output: bool = True, lora=None):
    from hapo_megatron.models import build_gpt_model

    # Weights are overwritten right away: skip the random init (minutes for an 8B model).
    # No run config here: Transformer Engine layers when usable, no sequence parallelism.
    return build_gpt_model(hf_config, dtype=dtype, parallel_output=parallel_output, perform_initialization=False,
                           use_te=None, sequence_parallel=False, lora=lora)


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=_rank() != 0)


def hf_to_megatron(args) -> int:
    """HF safetensors -> Megatron torch_dist checkpoint at --tp x --pp."""
    from transformers import AutoConfig

    from hapo_megatron.convert import HFCheckpointReader, check_hf_state, get_adapter, load_hf_weights_into_mcore
    from hapo_megatron.convert import save_megatron_checkpoint
    from hapo_megatron.convert.model_io import chunk_entries

    from hapo_megatron.models.hub import resolve_model_path

    _check_output_dir(args.megatron_path, args.overwrite)
    try:  # a hub name -> its local snapshot (weights, config and tokenizer), or a clear error
        args.hf_model_path = resolve_model_path(args.hf_model_path, "--hf-model-path")
    except (ValueError, FileNotFoundError) as e:
        raise ConversionError(str(e)) from None
    hf_config = AutoConfig.from_pretrained(args.hf_model_path)
    adapter = get_adapter(hf_config)  # refuses unsupported architectures
    reader = HFCheckpointReader(args.hf_model_path)
    check_hf_state(adapter, list(reader.keys()), reader.shape)  # before any heavy work
    dtype = torch_dtype(args.dtype) if args.dtype else _hf_dtype(hf_config)
    groups = _init(args.tp, args.pp, args.ep, args.etp)
    model = _build(hf_config, dtype)
    bar = _progress(len(chunk_entries(adapter, model)), "load HF tensors")
    load_hf_weights_into_mcore(model, reader, hf_config, tp_rank=groups.tp_rank, tp_size=groups.tp_size,
                               pp_rank=groups.pp_rank, pp_size=groups.pp_size, etp_rank=groups.etp_rank,
                               etp_size=groups.etp_size, progress=lambda _: bar.update())
    bar.close()
    _prepare_dir_rank0(args.megatron_path, args.overwrite)
    meta = {"tp": args.tp, "pp": args.pp, "ep": groups.ep_size, "etp": groups.etp_size, "dtype": short_name(dtype),
            "source": os.path.abspath(args.hf_model_path), "arch": adapter.arch}
    save_megatron_checkpoint([model], args.megatron_path, hf_config=hf_config, tokenizer_src=args.hf_model_path,
                             meta=meta)
    _log(f"saved Megatron torch_dist checkpoint ({adapter.arch}, tp={args.tp}, pp={args.pp}, ep={groups.ep_size}, "
         f"etp={groups.etp_size}, {short_name(dtype)}) to {args.megatron_path}")
    _finish()
    return 0


def _prepare_dir_rank0(path: str, overwrite: bool) -> None:
    import torch.distributed as dist

    from hapo_megatron.convert import prepare_output_dir

    if _rank() == 0:
        prepare_output_dir(path, overwrite)
    if dist.is_initialized():
        dist.barrier()


def _checkpoint_meta(megatron_path: str) -> dict:
    from hapo_megatron.convert.megatron_ckpt import META_NAME

    meta_path = os.path.join(megatron_path, META_NAME)
    if not os.path.isfile(meta_path):
        return {}
    with open(meta_path) as f:
        return json.load(f)


def _megatron_side(args):
    """(hf_config, tokenizer_src, dtype) of a Megatron checkpoint."""
    from transformers import AutoConfig

    from hapo_megatron.config.run_identity import run_context_length
    from hapo_megatron.convert import read_hf_config
    from hapo_megatron.convert.megatron_ckpt import HF_SUBDIR
    from hapo_megatron.models.hub import resolve_model_path

    if not os.path.isdir(args.megatron_path):
        raise ConversionError(f"--megatron-path {args.megatron_path!r} is not a directory")
    src = getattr(args, "hf_config_path", None)
    if src:  # a hub name -> its local snapshot, tokenizer included (or a clear error)
        try:
            src = resolve_model_path(src, "--hf-config-path")
        except (ValueError, FileNotFoundError) as e:
            raise ConversionError(str(e)) from None
    hf_config = AutoConfig.from_pretrained(src) if src else read_hf_config(args.megatron_path)
    context = getattr(args, "max_position_embeddings", None)
    if context is None and hasattr(args, "max_position_embeddings"):  # export: the run's own context
        context = run_context_length(args.megatron_path)
        if context is not None:
            _log(f"max_position_embeddings={context} from the run's saved config (model.max_position_embeddings)")
    if context:
        hf_config.max_position_embeddings = int(context)
    meta = _checkpoint_meta(args.megatron_path)
    dtype = torch_dtype(args.dtype) if args.dtype else TORCH_DTYPES.get(meta.get("dtype"), torch.float32)
    return hf_config, src or os.path.join(args.megatron_path, HF_SUBDIR), dtype


def _lora_side(args):
    """The `models.lora.LoraSettings` and the base model's directory of a LoRA training checkpoint
    (None, None for any other); the base must be the one it was trained on (its weights hash)."""
    from hapo_megatron.models.lora_checkpoint import base_weights_hash, read_record, settings_of

    record = read_record(args.megatron_path)
    if record is None:
        if args.lora_base or args.lora_format != "merged":
            raise ConversionError(f"--lora-base / --lora-format: {args.megatron_path!r} is not a LoRA checkpoint "
                                  "(no lora.json)")
        return None, None
    base = args.lora_base or record["base_model_path"]
    if not os.path.isdir(base):
        raise ConversionError(f"--lora-base: the LoRA base model {base!r} is not a directory (the checkpoint's "
                              "adapters need the weights they were trained on)")
    if base_weights_hash(base) != record["base_weights_hash"]:
        raise ConversionError(f"--lora-base: the weights in {base!r} are not the base the adapters were trained on "
                              f"({record['base_model_path']}, hash {record['base_weights_hash']})")
    if not args.hf_config_path:
        args.hf_config_path = base
    return settings_of(record), base


def megatron_to_hf(args) -> int:
    """Megatron torch_dist checkpoint -> HF safetensors (sharded, with index, config, tokenizer); a
    LoRA training checkpoint -> the merged model, or a PEFT adapter directory (--lora-format peft)."""
    from hapo_megatron.convert import export_hf_weights, get_adapter, load_megatron_checkpoint, save_hf_checkpoint

    _check_output_dir(args.hf_model_path, args.overwrite)
    lora, base = _lora_side(args)
    hf_config, tokenizer_src, dtype = _megatron_side(args)
    if lora is not None and not args.dtype:
        dtype = _hf_dtype(hf_config)  # the base's: the adapter-only checkpoint records no dtype
    if not any(os.path.isfile(os.path.join(tokenizer_src, f)) for f in ("tokenizer.json", "tokenizer.model",
                                                                          "vocab.json")):
        _log(f"warning: no tokenizer files in {tokenizer_src}: SGLang and vLLM cannot load the export without "
             "them; pass --hf-config-path with the model's directory or hub name (docs/conversion.md)")
    adapter = get_adapter(hf_config)
    groups = _init(args.tp, args.pp, args.ep, args.etp)
    model = _build(hf_config, dtype, lora=lora)
    if lora is None:
        load_megatron_checkpoint([model], args.megatron_path)
    else:
        from hapo_megatron.convert import load_hf_weights_into_mcore
        from hapo_megatron.convert.megatron_ckpt import load_lora_adapters
        load_hf_weights_into_mcore(model, base, hf_config, tp_rank=groups.tp_rank, tp_size=groups.tp_size,
                                   pp_rank=groups.pp_rank, pp_size=groups.pp_size, etp_rank=groups.etp_rank,
                                   etp_size=groups.etp_size)
        load_lora_adapters(model, args.megatron_path)
        if args.lora_format == "peft":
            return _save_peft(args, model, groups, lora, base, dtype)
    stream = export_hf_weights([model], hf_config, tp_group=groups.tp, pp_group=groups.pp, ep_group=groups.ep,
                               etp_group=groups.etp)
    if _rank() == 0:
        bar = _progress(len(adapter.hf_shapes()), "export HF tensors")
        save_hf_checkpoint(stream, args.hf_model_path, hf_config, tokenizer_src=tokenizer_src,
                           max_shard_bytes=int(args.max_shard_size_gb * 1024**3), overwrite=args.overwrite,
                           progress=lambda _: bar.update())
        bar.close()
    else:
        for _ in stream:  # every rank takes part in the gathers
            pass
    merged = " (LoRA adapters merged into the base)" if lora is not None else ""
    _log(f"saved HF checkpoint ({adapter.arch}, {short_name(dtype)}){merged} to {args.hf_model_path}")
    _finish()
    return 0


def _save_peft(args, model, groups, lora, base: str, dtype) -> int:
    from hapo_megatron.convert.peft_export import peft_state_dict, save_peft_adapter

    state = peft_state_dict([model], tp_group=groups.tp, pp_group=groups.pp)
    if _rank() == 0:
        from hapo_megatron.convert import prepare_output_dir
        prepare_output_dir(args.hf_model_path, args.overwrite)
        save_peft_adapter(state, lora, args.hf_model_path, base_model_path=os.path.abspath(base), dtype=dtype)
    _log(f"saved a PEFT adapter directory ({len(state)} tensors, rank {lora.rank}, base {base}) to "
         f"{args.hf_model_path}")
    _finish()
    return 0


def check(args) -> int:
    """Max abs difference of the logits of both sides on a fixed prompt (PP must be 1)."""
    from transformers import AutoModelForCausalLM

    from hapo_megatron.convert import load_megatron_checkpoint
    from hapo_megatron.parallel.collectives import broadcast_object

    hf_config, _, _ = _megatron_side(args)
    dtype = torch_dtype(args.dtype or "fp32")
    ids = _prompt_ids(args.hf_model_path, args.prompt, hf_config.vocab_size)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _init(args.tp, 1, args.ep, args.etp)
    model = _build(hf_config, dtype, parallel_output=False)
    load_megatron_checkpoint([model], args.megatron_path)
    model.eval()
    ids = ids.to(device)
    with torch.no_grad():
        pos = torch.arange(ids.shape[1], device=device).unsqueeze(0)
        logits = model(ids, pos, None)[..., : hf_config.vocab_size].float()
    diff = None
    if _rank() == 0:
        hf = AutoModelForCausalLM.from_pretrained(args.hf_model_path, **_hf_dtype_kw(dtype)).to(device).eval()
        with torch.no_grad():
            ref = hf(ids).logits.float()
        diff = (logits - ref).abs().max().item()
        _log(f"prompt tokens: {ids.shape[1]}  max |logit diff|: {diff:.3e}  "
             f"(max |logit| {ref.abs().max().item():.3e}, dtype {short_name(dtype)})")
    ok = broadcast_object(diff is None or diff <= args.tolerance)
    _finish()
    if not ok:
        print(f"error: logit difference {diff:.3e} exceeds --tolerance {args.tolerance}", file=sys.stderr)
        return 1
    return 0


def _hf_dtype_kw(dtype: torch.dtype) -> dict:
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}


def _prompt_ids(hf_path: str, prompt: str, vocab: int) -> torch.Tensor:
    """Token ids `[1, T]` of `prompt`: the checkpoint's tokenizer, or byte values mod vocab without one."""
    ids: list[int] = []
    if any(os.path.isfile(os.path.join(hf_path, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(hf_path)(prompt)["input_ids"]
    if not ids or max(ids) >= vocab:
        ids = [b % vocab for b in prompt.encode()]
    return torch.tensor([ids], dtype=torch.long)


def tiny_model(args) -> int:
    """Write a tiny random HF model (tests, README walk-through, CPU example)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hapo_megatron.convert import copy_tokenizer_files
    from hapo_megatron.models import tiny_hf_config

    _check_output_dir(args.out, args.overwrite)
    overrides = {}
    if args.tokenizer:
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        overrides = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    cfg = tiny_hf_config(args.arch, num_hidden_layers=args.layers, **overrides)
    torch.manual_seed(args.seed)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(args.out)
    copy_tokenizer_files(args.tokenizer, args.out)
    print(f"saved a tiny random {args.arch} model to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="hapo convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-megatron", help="HF safetensors -> Megatron torch_dist")
    b = sub.add_parser("megatron-to-hf", help="Megatron torch_dist -> HF safetensors")
    c = sub.add_parser("check", help="max abs logit difference between an HF and a Megatron checkpoint")
    for s in (a, b, c):
        s.add_argument("--hf-model-path", required=True, help="HF model directory (output for megatron-to-hf)")
        s.add_argument("--megatron-path", required=True,
                       help="Megatron checkpoint directory (output for hf-to-megatron)")
        s.add_argument("--tp", type=int, default=1, help="tensor parallel size (= ranks under torchrun with --pp)")
        s.add_argument("--ep", type=int, default=1, help="expert model parallel size (MoE models)")
        s.add_argument("--etp", type=int, default=None,
                       help="expert tensor parallel size (MoE models; default: --tp)")
        s.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default=None,
                       help="weights dtype (default: the source's dtype; fp32 for check)")
    for s in (a, b):
        s.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
        s.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    b.add_argument("--hf-config-path", default=None,
                   help="HF config/tokenizer directory or hub name (resolved to its local snapshot in the HF "
                        "cache; default: the one stored in the Megatron checkpoint)")
    b.add_argument("--max-position-embeddings", type=int, default=None,
                   help="write this max_position_embeddings into the exported config.json (default: "
                        "model.max_position_embeddings of the run's saved config.yaml, when the checkpoint "
                        "is in a run directory and it was set)")
    b.add_argument("--lora-format", choices=("merged", "peft"), default="merged",
                   help="a LoRA training checkpoint: write the merged model (W + alpha/r B A, like a full run's "
                        "export) or a PEFT adapter directory (adapter_model.safetensors + adapter_config.json) "
                        "to load with peft onto the base model")
    b.add_argument("--lora-base", default=None,
                   help="a LoRA training checkpoint: the base model's HF directory (default: the path recorded in "
                        "its lora.json; its weights must hash as recorded)")
    b.add_argument("--max-shard-size-gb", type=float, default=2.0, help="safetensors shard size")
    c.add_argument("--prompt", default=DEFAULT_PROMPT, help="text of the fixed prompt")
    c.add_argument("--tolerance", type=float, default=float("inf"), help="exit 1 when the difference is larger")
    t = sub.add_parser("tiny-model", help="write a tiny random HF model (llama | qwen2 | qwen3 | qwen3_moe)")
    t.add_argument("--arch", choices=list(SUPPORTED_ARCHS), default="llama")
    t.add_argument("--out", required=True, help="output directory")
    t.add_argument("--layers", type=int, default=2, help="number of layers")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--tokenizer", default=None, help="tokenizer directory to copy (sets vocab_size to match)")
    t.add_argument("--overwrite", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    run = {"hf-to-megatron": hf_to_megatron, "megatron-to-hf": megatron_to_hf, "check": check,
           "tiny-model": tiny_model}[args.command]
    try:
        return run(args)
    except (ConversionError, ValueError, FileExistsError) as err:
        prefix = f"[rank {_rank()}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        print(f"{prefix}error: {err}", file=sys.stderr)
        return 1
    finally:
        if _OWNED:  # an error left groups behind that this command created
            _finish()


if __name__ == "__main__":
    sys.exit(main())
