"""Weight-sync building blocks: bucketing, flattening, payloads, disk checkpoints."""

import json
import os

import pytest
import torch

from hapo_megatron.rollout.sglang import weight_sync as ws
from hapo_megatron.rollout.sglang.processor import SGLANG_AVAILABLE


def named(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(4, 8), (8,), (16, 4), (3,), (40,), (2, 2, 2), (5, 3)]
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32, torch.float16, torch.float16]
    return [(f"model.layers.{i}.w", torch.randn(shapes[i], generator=g).to(dtypes[i])) for i in range(n)]


def loop_buckets(items, cap, split_on_dtype):
    """Independent reference: greedy sequential packing."""
    out, cur, size = [], [], 0
    for name, t in items:
        nb = t.numel() * t.element_size()
        new = cur and (size + nb > cap or (split_on_dtype and cur[-1][1].dtype != t.dtype))
        if new:
            out.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += nb
    return out + ([cur] if cur else [])


@pytest.mark.parametrize("cap", [1, 40, 64, 100, 160, 10_000])
@pytest.mark.parametrize("split_on_dtype", [True, False])
def test_bucket_named_tensors(cap, split_on_dtype):
    items = named()
    buckets = list(ws.bucket_named_tensors(iter(items), cap, split_on_dtype=split_on_dtype))
    assert [[n for n, _ in b] for b in buckets] == [[n for n, _ in b] for b in loop_buckets(items, cap, split_on_dtype)]
    assert [x for b in buckets for x in b] == items  # order and identity preserved
    for b in buckets:
        size = sum(ws.tensor_nbytes(t) for _, t in b)
        assert size <= cap or len(b) == 1  # only a single oversize tensor may exceed the cap
        if split_on_dtype:
            assert len({t.dtype for _, t in b}) == 1


def test_bucketing_is_lazy_and_validates():
    consumed = []

    def stream():
        for item in named():
            consumed.append(item[0])
            yield item

    it = ws.bucket_named_tensors(stream(), 200, split_on_dtype=False)
    first = next(it)
    assert len(consumed) == len(first) + 1  # one tensor of look-ahead, not the whole stream
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(ws.bucket_named_tensors(named(), 0))
    with pytest.raises(ValueError, match="pairs"):
        list(ws.bucket_named_tensors([("a", [1, 2])], 10))
    assert list(ws.bucket_named_tensors([], 10)) == []


def test_with_last():
    assert list(ws.with_last([])) == []
    assert list(ws.with_last("abc")) == [("a", False), ("b", False), ("c", True)]


def test_flatten_round_trip_and_distributed_payload():
    bucket = [(n, t) for n, t in named() if t.dtype == torch.float32]
    flat, meta = ws.flatten_bucket(bucket)
    assert flat.dtype == torch.uint8 and flat.numel() == sum(ws.tensor_nbytes(t) for _, t in bucket)
    for (n, t), (n2, t2) in zip(bucket, ws.unflatten_bucket(flat, meta)):
        assert n == n2 and t2.dtype == t.dtype and torch.equal(t, t2)
    body = ws.distributed_update_payload(bucket, group_name="g", flush_cache=True)
    assert body == {"names": [n for n, _ in bucket], "dtypes": ["float32"] * len(bucket),
                    "shapes": [list(t.shape) for _, t in bucket], "group_name": "g",
                    "load_format": "flattened_bucket", "flush_cache": True}
    assert ws.dtype_name(torch.bfloat16) == "bfloat16"
    assert ws.init_group_payload(master_address="h", master_port=5, rank_offset=3, world_size=9, group_name="g") == {
        "master_address": "h", "master_port": 5, "rank_offset": 3, "world_size": 9, "group_name": "g",
        "backend": "nccl"}


@pytest.mark.skipif(not SGLANG_AVAILABLE, reason="sglang not installed")
def test_flat_layout_matches_sglang_receiver():
    """The receiver allocates FlattenedTensorBucket.empty(names, dtypes, shapes) and views it."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    for bucket in ws.bucket_named_tensors(named(), 1 << 20):
        flat, _ = ws.flatten_bucket(bucket)
        body = ws.distributed_update_payload(bucket, group_name="g", flush_cache=False)
        recv = FlattenedTensorBucket.empty(body["names"], body["dtypes"], body["shapes"], "cpu")
        recv.get_flattened_tensor().copy_(flat)  # what the NCCL broadcast does
        got = recv.reconstruct_tensors()
        assert [n for n, _ in got] == [n for n, _ in bucket]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, bucket))


@pytest.mark.skipif(not SGLANG_AVAILABLE, reason="sglang not installed")
def test_serialized_tensor_bucket_decodes_with_sglang():
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    bucket = named()[:2]
    blobs, keepalive = ws.serialize_bucket_for_sglang(bucket, 2)
    body = ws.tensor_update_payload(blobs, flush_cache=False)
    assert body["load_format"] == "flattened_bucket" and len(body["serialized_named_tensors"]) == 2
    data = MultiprocessingSerializer.deserialize(body["serialized_named_tensors"][1])  # SGLang's safe unpickler
    fb = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
    got = fb.reconstruct_tensors()
    assert [(n, t.dtype, tuple(t.shape)) for n, t in got] == [(n, t.dtype, tuple(t.shape)) for n, t in bucket]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, bucket))
    with pytest.raises(ValueError):
        ws.tensor_update_payload([], flush_cache=True)


def test_write_hf_checkpoint_loads_in_transformers(tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    src = transformers.LlamaForCausalLM(cfg)
    src_dir = tmp_path / "orig"
    cfg.save_pretrained(src_dir)
    sd = src.state_dict()
    shards = ws.write_hf_checkpoint(iter(sd.items()), str(tmp_path / "out"), shard_bytes=20_000,
                                    config_dir=str(src_dir))
    assert len(shards) > 1
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(sd) and os.path.exists(tmp_path / "out" / "config.json")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in sd.items())
