"""The figures a GPU user compares with published runs (docs/multinode.md, "Throughput figures").

- ``perf/tokens_per_s_per_gpu``: the step's trained tokens (prompt + response of every kept
  sequence) per second of the whole step (rollout, update, sync, ...) per training GPU: NeMo-RL's
  "Tokens/sec/GPU" over a whole RL step.
- ``perf/model_tflops_per_gpu``: the update phase's *model* FLOPs (forward + backward of every
  trained token, each PPO epoch; activation recomputation not counted, as MFU conventions do) per
  second of the update phase per training GPU.

The cost model (`ModelFlops`) counts the multiply-adds of the matrix products of one forward pass
(2 FLOPs each) from the HF config: per token the attention projections, the MLP (dense
``3 h ffn``; a sparse layer its router and its top-k experts: MoE by active parameters) and the
output layer; per sequence of ``s`` tokens the causal attention scores and values,
``2 * heads * head_dim * s (s + 1)`` per layer (each query attends to itself and the tokens before
it). Element-wise work (norms, activations, RoPE, softmax) is left out, as in Megatron's and
NeMo's counts. Backward costs twice the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hapo_megatron.models.hf_config import head_dim_of, moe_layer_pattern, num_kv_heads_of

BACKWARD_FACTOR = 2  # the backward pass multiplies twice as much as the forward (input and weight grads)


@dataclass(frozen=True)
class ModelFlops:
    """Forward FLOPs of a decoder: ``per_token`` (every product whose cost grows with the token
    count) and ``attention_width`` (heads x head_dim, what the per-sequence score and value
    products scale with), summed over the layers."""

    per_token: int
    attention_width: int
    num_layers: int

    @staticmethod
    def of(hf_config) -> "ModelFlops":
        h, hd = int(hf_config.hidden_size), head_dim_of(hf_config)
        q_width, kv_width = int(hf_config.num_attention_heads) * hd, num_kv_heads_of(hf_config) * hd
        attention = h * q_width + 2 * h * kv_width + q_width * h  # q, k, v, o projections
        per_layer = []
        for sparse in moe_layer_pattern(hf_config):
            if sparse:  # the router, then each token through its top-k experts (gate, up, down)
                mlp = h * int(hf_config.num_experts) + \
                    int(hf_config.num_experts_per_tok) * 3 * h * int(hf_config.moe_intermediate_size)
            else:
                mlp = 3 * h * int(hf_config.intermediate_size)
            per_layer.append(attention + mlp)
        output_layer = h * int(hf_config.vocab_size)
        return ModelFlops(per_token=2 * (sum(per_layer) + output_layer), attention_width=q_width,
                          num_layers=len(per_layer))

    def forward(self, seq_lens, *, causal: bool = True) -> float:
        """Forward FLOPs of sequences of ``seq_lens`` tokens (each its own attention span, as packed
        sequences are). ``causal=False``: every query attends to every key (what a plain matmul
        count of an unmasked attention gives; for tests)."""
        s = np.asarray(seq_lens, dtype=np.float64).reshape(-1)
        pairs = s * (s + 1) / 2 if causal else s * s  # query-key pairs per sequence
        # scores (q.k) and values (p.v): 2 products of `attention_width` multiply-adds per pair
        attention = self.num_layers * 2 * 2 * self.attention_width * pairs.sum()
        return float(self.per_token * s.sum() + attention)

    def train(self, seq_lens, *, epochs: int = 1) -> float:
        """Model FLOPs of ``epochs`` forward + backward passes over the sequences."""
        return float(epochs) * (1 + BACKWARD_FACTOR) * self.forward(seq_lens)


def step_perf_metrics(flops: ModelFlops, seq_lens, *, step_s: float, update_s: float, num_gpus: int,
                      epochs: int) -> dict[str, float]:
    """``perf/tokens_per_s_per_gpu`` and ``perf/model_tflops_per_gpu`` of one step (module docstring)."""
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    tokens = float(np.asarray(seq_lens, dtype=np.float64).sum())
    return {"perf/tokens_per_s_per_gpu": tokens / max(step_s, 1e-9) / num_gpus,
            "perf/model_tflops_per_gpu": flops.train(seq_lens, epochs=epochs) / max(update_s, 1e-9) / num_gpus / 1e12}


__all__ = ["BACKWARD_FACTOR", "ModelFlops", "step_perf_metrics"]
