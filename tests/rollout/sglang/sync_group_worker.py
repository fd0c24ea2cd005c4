"""``python -m tests.rollout.sglang.sync_group_worker OUT_DIR``: the trainer's side of one
distributed weight sync on CPU, run by tests/rollout/sglang/test_sync_group.py in torchrun's
environment (``TORCHELASTIC_USE_AGENT_STORE=True``).

The engine (`SGLangEngine`, ``weight_sync="distributed"``) talks to a fake HTTP session; its
``/init_weights_update_group`` starts the server's side of the group in a process of its own: SGLang's
own ``init_custom_process_group`` joined through ``tcp://`` as a server TP rank does (SGLang 0.5.23
``weight_updater.py``), in the environment a launched server gets (``launch.server_env``), which then
receives the broadcast bucket into a CPU buffer and saves it to ``OUT_DIR/received.pt``."""

import os
import subprocess
import sys

import torch

from hapo_megatron.rollout.sglang.launch import server_env
from tests.rollout.sglang.engines import sglang_engine
from tests.rollout.sglang.fake_sglang import FakeSession

PEER = """import sys, torch
from sglang.srt.utils import init_custom_process_group
addr, port, world, rank, name, backend, nbytes, out = sys.argv[1:]
pg = init_custom_process_group(backend=backend, init_method=f"tcp://{addr}:{port}", world_size=int(world),
                               rank=int(rank), group_name=name)
buf = torch.empty(int(nbytes), dtype=torch.uint8)
torch.distributed.broadcast(buf, group=pg, group_src=0)
torch.save(buf, out)
"""


def tensors() -> list[tuple[str, torch.Tensor]]:
    """What the trainer sends (one bucket)."""
    g = torch.Generator().manual_seed(0)
    return [("model.embed_tokens.weight", torch.randn(16, 8, generator=g)),
            ("model.norm.weight", torch.randn(8, generator=g))]


class PeerSession(FakeSession):
    """A fake server whose weight-update group is a real process (``PEER``)."""

    def __init__(self, out: str, nbytes: int):
        super().__init__()
        self.out, self.nbytes, self.peer = out, nbytes, None

    def post(self, url, json=None, timeout=None, headers=None):
        if url.endswith("/init_weights_update_group"):
            args = [json[k] for k in ("master_address", "master_port", "world_size", "rank_offset", "group_name",
                                      "backend")]
            self.peer = subprocess.Popen([sys.executable, "-c", PEER, *map(str, args), str(self.nbytes), self.out],
                                         env=server_env(cpu=True))
        return super().post(url, json=json, timeout=timeout, headers=headers)


def main(out_dir: str) -> int:
    named = tensors()
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    session = PeerSession(os.path.join(out_dir, "received.pt"), nbytes)
    eng = sglang_engine(server_urls=["http://127.0.0.1:1"], launch=False, colocate=False, weight_sync="auto",
                        session=session, device="cpu", api_key="k" * 32, bucket_size_mb=1)
    assert eng.weight_sync == "distributed"
    eng.update_weights(iter(named), weight_version=1)
    assert session.peer.wait() == 0, "the server's side of the group failed"
    eng.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
