"""LoRA adapters on Transformer Engine's layers (GPU only; `@pytest.mark.gpu`).

The TE spec's adapted layers are TELayerNormColumnParallelLinear (q/k/v, gate/up: the adapter
recomputes the fused norm from the layer's own weight and eps) and TERowParallelLinear (o, down).
With the same base weights and adapters, the TE model's logits equal the local spec's (CPU, float32)
and its merged export, loaded into transformers, gives its own logits. Tolerance: float32 on two
devices and kernels (TE's fused norm + GEMM vs torch's), a few ulps of each sum through two layers;
1e-4 of the logits' scale leaves room for TF32-free cuBLAS reductions in another order.
"""

import numpy as np
import pytest
import torch

from tests.convert.dist_checks import random_hf_model
from tests.distributed import run_distributed
from tests.models.test_lora import ARCH, _set_adapters, _settings

RTOL = 1e-4


def _te_vs_local(rank, world):
    from hapo_megatron.convert import gather_hf_state_dict, load_hf_weights_into_mcore
    from hapo_megatron.models import build_gpt_model
    from hapo_megatron.models.lora import freeze_base
    from hapo_megatron.parallel.groups import destroy_parallel, initialize_parallel

    torch.backends.cuda.matmul.allow_tf32 = False
    initialize_parallel(tp=1, seed=5)
    cfg, hf = random_hf_model(ARCH)
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(8).unsqueeze(0).expand_as(ids)
    out = {}
    for name, use_te, device in (("local", False, "cpu"), ("te", True, "cuda")):
        m = build_gpt_model(cfg, sequence_parallel=False, use_te=use_te, lora=_settings()).to(device)
        kinds = {type(x).__name__ for x in m.modules() if hasattr(x, "lora")}
        load_hf_weights_into_mcore(m, hf.state_dict(), cfg, tp_rank=0, tp_size=1)
        freeze_base(m)
        _set_adapters(m, 0, 1)
        with torch.no_grad():
            out[name] = m(ids.to(device), pos.to(device), None)[..., :cfg.vocab_size].float().cpu().numpy()
        out[f"{name}_kinds"] = sorted(kinds)
        if use_te:
            out["exported"] = gather_hf_state_dict(m, cfg)
    destroy_parallel()
    hf.load_state_dict(out.pop("exported"), strict=False)
    with torch.no_grad():
        out["hf"] = hf(ids).logits.numpy()
    return out


@pytest.mark.gpu
def test_te_layers_carry_the_same_adapters_as_the_local_spec():
    pytest.importorskip("transformer_engine.pytorch")
    (res,) = run_distributed(_te_vs_local, 1, timeout=600)
    assert res["te_kinds"] == ["LoraTELayerNormColumnParallelLinear", "LoraTERowParallelLinear"], res["te_kinds"]
    scale = float(np.abs(res["local"]).max())
    assert float(np.abs(res["te"] - res["local"]).max()) <= RTOL * scale
    assert float(np.abs(res["hf"] - res["te"]).max()) <= RTOL * scale
