"""Module-level worker for the 2-rank SGLangEngine test (kept light: no SGLang import)."""

import os

import torch

from hapo_megatron.rollout.sglang.api_key import API_KEY_ENV
from hapo_megatron.rollout.engine import SamplingParams

from .fake_sglang import FakeSession
from tests.rollout.sglang.engines import sglang_engine

URLS = ["http://a:1", "http://b:2"]


def named_weights():
    g = torch.Generator().manual_seed(0)
    return [("model.embed_tokens.weight", torch.randn(64, 32, generator=g).bfloat16()),
            ("model.layers.0.mlp.up_proj.weight", torch.randn(64, 32, generator=g).bfloat16()),
            ("model.norm.weight", torch.randn(32, generator=g).bfloat16()),
            ("lm_head.weight", torch.randn(64, 32, generator=g).bfloat16())]


def collective_worker(rank, world_size, tmp_dir):
    from hapo_megatron.rollout.sglang import weight_sync as ws

    ws.serialize_bucket_for_sglang = lambda bucket, num_ranks=1: (
        [f"rank{rank}:" + ",".join(n for n, _ in bucket)] * num_ranks, None)
    out = {}
    # one colocated server with tp=2 spanning both ranks: tensor sync gathers both ranks' handles;
    # only rank 0 knows the servers' key: the engine hands it to rank 1 over the process group
    sess = FakeSession()
    if rank == 0:
        os.environ[API_KEY_ENV] = "key-known-to-rank-0"
    eng = sglang_engine(server_urls=URLS[:1], server_tp_size=2, colocate=True, weight_sync="tensor",
                          session=sess, launch=False, bucket_size_mb=1, collective=True, device="cuda")
    os.environ.pop(API_KEY_ENV, None)
    out["auth"] = eng.http._auth
    eng.bucket_bytes = 64 * 32 * 2
    samples = eng.generate([[10], [20]], SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=3))
    out["samples"] = [[s.response_ids.tolist() for s in g] for g in samples]
    eng.update_weights(iter(named_weights()))
    eng.release_memory()
    out["tensor_posts"] = [b["serialized_named_tensors"] for _, b in sess.posts("/update_weights_from_tensor")]
    out["generate_posts"] = len(sess.posts("/generate"))
    out["sent_headers"] = [h for h in sess.headers if h is not None]
    out["release_posts"] = len(sess.posts("/release_memory_occupation"))
    # disk sync: rank 0 writes and posts, rank 1 only drains its iterator
    sess2 = FakeSession()
    eng2 = sglang_engine(server_urls=URLS, colocate=False, weight_sync="disk", session=sess2, launch=False,
                           collective=True,
                           disk_sync_dir=tmp_dir)
    drained = []

    def stream():
        for item in named_weights():
            drained.append(item[0])
            yield item

    eng2.update_weights(stream())
    out["disk_posts"] = len(sess2.posts("/update_weights_from_disk"))
    out["drained"] = len(drained)
    # rank-0-only engine (the trainer's default) inside a 2-rank job: no collectives (else: hang)
    if rank == 0:
        sess3 = FakeSession()
        eng3 = sglang_engine(server_urls=URLS[:1], server_tp_size=2, colocate=True, weight_sync="tensor",
                               session=sess3, launch=False, device="cuda")
        eng3.bucket_bytes = 64 * 32 * 2
        eng3.generate([[10]], SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=2))
        eng3.update_weights(iter(named_weights()))
        eng3.release_memory()
        out["solo_tensor_posts"] = [b["serialized_named_tensors"]
                                    for _, b in sess3.posts("/update_weights_from_tensor")]
    torch.distributed.barrier()
    return out
