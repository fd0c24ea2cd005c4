"""tools/bench/lora_sync.py at a tiny size: the bytes of both modes against hand counts (the full
weights: the model's parameter count x 2 bytes; the adapters: r x (in + out) per projection)."""

from tests.tools._load import load_tool


def test_bytes_by_hand(capsys):
    bench = load_tool("bench/lora_sync")
    from hapo_megatron.training.memory.plan import ModelShape, param_count
    r = bench.measure(layers=1, scale=64, rank=2, bucket_mb=1)
    d = r["dims"]  # hidden 56, head_dim 2 (28 heads: q 56, kv 8), FFN 296, vocab 2376
    h, q, kv, f = d["hidden"], 28 * d["head_dim"], 4 * d["head_dim"], d["ffn"]
    assert (h, q, kv, f, d["vocab"]) == (56, 56, 8, 296, 2376)
    per_layer = 2 * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + f) + (f + h))
    assert r["lora_bytes"] == 2 * per_layer
    shape = ModelShape(hidden=h, layers=1, heads=28, kv_heads=4, head_dim=2, intermediate=f, vocab=2376,
                       qkv_bias=True)
    assert r["full_bytes"] == 2 * param_count(shape)
    assert bench.main(["--layers", "1", "--scale", "64", "--rank", "2", "--bucket-mb", "1"]) == 0
    assert "fewer bytes" in capsys.readouterr().out
