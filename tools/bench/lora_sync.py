"""Weight-sync bytes and payload time per step: LoRA adapters (A and B only) vs the full weights.

At the 7B recipe's shapes (Qwen2.5-Math-7B: hidden 3584, 28 layers, 28 heads / 4 KV heads of 128,
FFN 18944, vocab 152064, untied, QKV bias) with synthetic bf16 tensors, one run prints for each
mode the bytes one sync hands the engine (`stages.SyncBytes`, ``rollout/weight_sync_bytes``) and
the time to build its SGLang payload on this host, the trainer's side of the sync:

- **full**: every HF tensor, bucketed (``rollout.sglang.bucket_size_mb``), each bucket flattened
  and serialised for ``/update_weights_from_tensor`` (by value on CPU, as `weight_sync` does);
  what ``lora_sync: merged`` sends, plus the merge ``W + (alpha/r) B A`` of every adapted weight;
- **adapter**: the peft-named A and B of every targeted projection in one
  ``/load_lora_adapter_from_tensors`` body (`weight_sync.lora_adapter_payload`).

One tensor is alive at a time on the full side (they are made, sent into a bucket and dropped), so
the 15 GB of a 7B model never sit in memory at once. Server-side loading and the network are not
measured. ``--layers``/``--scale`` shrink the model for a quick run (the smoke test).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
TARGETS = ATTN + ("gate_proj", "up_proj", "down_proj")


def shapes(hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128, ffn=18944, vocab=152064):
    """(name, shape) of every HF tensor of a Qwen2 decoder, and {projection: (in, out)}."""
    q, kv = heads * head_dim, kv_heads * head_dim
    proj = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, ffn), "up_proj": (hidden, ffn), "down_proj": (ffn, hidden)}
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        pre = f"model.layers.{i}"
        for p, (n_in, n_out) in proj.items():
            owner = "self_attn" if p in ATTN else "mlp"
            out.append((f"{pre}.{owner}.{p}.weight", (n_out, n_in)))
            if p in ("q_proj", "k_proj", "v_proj"):
                out.append((f"{pre}.self_attn.{p}.bias", (n_out,)))
        out += [(f"{pre}.input_layernorm.weight", (hidden,)), (f"{pre}.post_attention_layernorm.weight", (hidden,))]
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return out, proj


def _full(named_shapes, proj, rank, bucket_bytes, dtype):
    from hapo_megatron.rollout.sglang import weight_sync as ws
    from hapo_megatron.training.stages import SyncBytes

    a = {p: torch.ones(rank, n_in, dtype=dtype) for p, (n_in, _) in proj.items()}
    b = {p: torch.ones(n_out, rank, dtype=dtype) for p, (_, n_out) in proj.items()}

    def stream():
        for name, shape in named_shapes:
            t = torch.ones(shape, dtype=dtype)
            p = name.split(".")[-2]
            if name.endswith(".weight") and p in proj:  # merged: W + (alpha / r) B A, in float32
                t = (t.float() + (b[p].float() @ a[p].float())).to(dtype)
            yield name, t

    counted = SyncBytes(stream())
    t0 = time.perf_counter()
    for bucket in ws.bucket_named_tensors(counted, bucket_bytes):
        ws.serialize_bucket_for_sglang(bucket, 1)
    return counted.bytes, time.perf_counter() - t0


def _adapter(layers, proj, rank, dtype):
    from hapo_megatron.rollout.sglang import weight_sync as ws
    from hapo_megatron.training.stages import SyncBytes

    def stream():
        for i in range(layers):
            for p, (n_in, n_out) in proj.items():
                pre = f"base_model.model.model.layers.{i}.{'self_attn' if p in ATTN else 'mlp'}.{p}"
                yield f"{pre}.lora_A.weight", torch.ones(rank, n_in, dtype=dtype)
                yield f"{pre}.lora_B.weight", torch.ones(n_out, rank, dtype=dtype)

    counted = SyncBytes(stream())
    t0 = time.perf_counter()
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 32, "target_modules": list(TARGETS)}
    ws.lora_adapter_payload(list(counted), config, lora_name=ws.lora_adapter_name(1))
    return counted.bytes, time.perf_counter() - t0


def measure(layers=28, scale=1, rank=32, bucket_mb=512, dtype=torch.bfloat16) -> dict:
    dims = dict(hidden=3584 // scale, layers=layers, heads=28, kv_heads=4, head_dim=128 // scale,
                ffn=18944 // scale, vocab=152064 // scale)
    named, proj = shapes(**dims)
    full_bytes, full_s = _full(named, proj, rank, bucket_mb << 20, dtype)
    lora_bytes, lora_s = _adapter(layers, proj, rank, dtype)
    return {"dims": dims, "rank": rank, "full_bytes": full_bytes, "full_s": full_s, "lora_bytes": lora_bytes,
            "lora_s": lora_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--scale", type=int, default=1, help="divide hidden, head_dim, FFN and vocab by this")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--bucket-mb", type=int, default=512)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    r = measure(args.layers, args.scale, args.rank, args.bucket_mb)
    print(f"# Qwen2.5-Math-7B shapes {r['dims']}, bf16, LoRA rank {r['rank']} on all 7 projections, "
          f"bucket {args.bucket_mb} MiB, 1 thread")
    print(f"{'mode':<8} {'sync bytes':>16} {'GiB':>9} {'payload s':>10}")
    for mode in ("full", "lora"):
        print(f"{mode:<8} {r[mode + '_bytes']:>16,d} {r[mode + '_bytes'] / 2**30:>9.3f} {r[mode + '_s']:>10.2f}")
    print(f"ratio    {r['full_bytes'] / r['lora_bytes']:>16.1f}x fewer bytes, "
          f"{r['full_s'] / max(r['lora_s'], 1e-9):.1f}x less payload time with adapters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
