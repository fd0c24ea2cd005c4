"""Load an FP8 checkpoint into SGLang's own model class with its block-FP8 config, on CPU, and save
the parameters the loader filled (run in a subprocess with the CPU server's environment:
`launcher.server_env(cpu=True)`; tests/rollout/sglang/test_fp8_sglang_loader.py).

    python -m tests.rollout.sglang.sglang_fp8_loader MODEL_DIR CLASS PORT OUT.pt

SGLang's process groups (gloo, one rank) and parallel context are set up as a server would;
`process_weights_after_loading` is NOT run (on a CPU without AMX it refuses block FP8, see
docs/testing.md): what is saved is what `load_weights` placed, which is what a weight sync sets.
"""

import importlib
import os
import sys

import torch

MODEL_CLASSES = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama",
                 "Qwen3MoeForCausalLM": "qwen3_moe"}


def main(model_dir: str, class_name: str, port: str, out: str) -> None:
    import sglang.srt.runtime_context as rc
    from safetensors.torch import load_file
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from transformers import AutoConfig

    set_global_server_args_for_scheduler(ServerArgs(model_path=model_dir, device="cpu", dtype="bfloat16",
                                                    quantization="fp8"))
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    rc.get_parallel().override_permanently(tp_size=1, pp_size=1, moe_ep_size=1, attn_dp_size=1, attn_cp_size=1,
                                           moe_dp_size=1)
    initialize_model_parallel(backend="gloo")
    rc.get_parallel().override_permanently(**{n: 0 for n in rc._parallel_fields() if n.endswith("_rank")})
    config = AutoConfig.from_pretrained(model_dir)
    quant = Fp8Config.from_config(config.quantization_config)  # as SGLang reads config.json
    torch.set_default_dtype(torch.bfloat16)
    cls = getattr(importlib.import_module(f"sglang.srt.models.{MODEL_CLASSES[class_name]}"), class_name)
    model = cls(config, quant_config=quant)
    state = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(model_dir, f)))
    model.load_weights(list(state.items()))
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out)


if __name__ == "__main__":
    main(*sys.argv[1:5])
