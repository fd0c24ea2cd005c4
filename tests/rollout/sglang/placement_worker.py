"""One rank of the two-node placement test (run by torchrun; see test_placement.py).

It goes through the trainer's own path: ``build.start_engine`` (every node's first rank
starts its servers, rank 0 releases them), ``stages.sync_weights`` (rank 0 resumes the weights,
every node's leader sends its node's servers its copy) and rank 0's generation, with stand-in
servers playing GPU servers (same command line, ``tests/rollout/sglang/standin_sglang_server.py``) and
a weight export that, like a TP all-gather inside one node, is collective per node only.

    torchrun --nnodes 2 --node-rank N --nproc-per-node 2 ... placement_worker.py OUT_DIR PORT_BASE
"""

import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin_sglang_server.py")
NAMES = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]


class NodeLocalExport:
    """``export_hf_weights`` stand-in: every rank yields every tensor after a collective of its node."""

    def __init__(self, node_group):
        self.node_group = node_group

    def export_hf_weights(self, dtype=None):
        for i, name in enumerate(NAMES):
            dist.all_reduce(torch.ones(1), group=self.node_group)
            yield name, torch.full((4, 4), float(i))


def main(out_dir: str, port_base: int) -> None:
    dist.init_process_group("gloo")
    from hapo_megatron.config import HapoConfig
    from hapo_megatron.rollout.sglang import launch as launcher
    from hapo_megatron.rollout.sglang import weight_sync as ws
    from hapo_megatron.rollout.engine import SamplingParams
    from hapo_megatron.training import build, stages

    rank, node = dist.get_rank(), int(os.environ["GROUP_RANK"])
    real_command = launcher.server_command

    def standin_command(*a, **k):  # the real command line, the stand-in's module in SGLang's place
        cmd = real_command(*a, **k)
        if cmd[1] == "-m":
            return [sys.executable, STANDIN] + cmd[3:]
        return [sys.executable, "-c", cmd[2].replace("sglang.launch_server", "standin_sglang_server")] + cmd[3:]

    launcher.server_command = standin_command
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(STANDIN), os.environ.get("PYTHONPATH")]))
    launcher.resolve_device = lambda device="auto": "cuda"  # the stand-ins play GPU servers
    ws.serialize_bucket_for_sglang = lambda bucket, num_ranks=1: (
        [f"node{node}:" + ",".join(n for n, _ in bucket)] * num_ranks, None)
    node_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cfg = HapoConfig.from_dict({
        "model": {"hf_model_path": "standin-model"}, "trainer": {"run_dir": out_dir},
        "rollout": {"engine": "sglang", "sglang": {"num_servers": 0, "server_tp_size": 1, "colocate": True,
                                                   "port_base": port_base}}})
    rt = SimpleNamespace(cfg=cfg, hf_config=None, tokenizer=None, is_main=rank == 0, engine=None,
                         actor=NodeLocalExport(node_groups[node]))
    build.start_engine(rt)
    out = {"rank": rank, "node": node, "pid": os.getpid(), "has_engine": rt.engine is not None}
    prompts = [[100 * p] for p in range(32)]  # 32 x n=8 rows = 4 calls of 64: one per server
    if rank == 0:
        out["urls"] = [s.url for s in rt.engine.servers]
        rt.memory.resume_generation()
        rt.engine.generate(prompts, SamplingParams(n=8, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=2))
        rt.memory.release_all()
    stages.sync_weights(rt)
    if rank == 0:
        rt.memory.resume_generation()
        groups = rt.engine.generate(prompts, SamplingParams(n=8, temperature=1.0, top_p=1.0, top_k=-1,
                                                            max_new_tokens=2))
        out["first_response"] = groups[1][0].response_ids.tolist()
    dist.barrier()  # as in the trainer: rank 0 is done with every server before a node stops its own
    if rt.engine is not None:
        rt.engine.shutdown()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
