"""Megatron-aware parallel layer: process groups are always passed in explicitly.

- `groups`: the only reader of Megatron's global parallel state (`initialize_parallel`).
- `vocab_parallel`: fused log-prob + entropy over vocab-sharded logits.
- `linear`: the same from hidden states and the output weight (no logits materialised).
- `stats`: exact global entropy statistics over DP x CP, global token counts.
- `context_parallel`: Megatron's CP sequence layout as index math.
- `micro_batch`: the typed micro-batch the forward pass and the loss read (`MicroBatch`).
- `loss`: the HAPO loss for `forward_backward_func` (per-token-loss path).
"""

from hapo_megatron.parallel.context_parallel import (
    all_gather_from_cp,
    cp_chunk_indices,
    cp_padded_length,
    gather_from_cp,
    split_for_cp,
)
from hapo_megatron.parallel.groups import (
    ParallelGroups,
    destroy_parallel,
    get_parallel_groups,
    initialize_parallel,
)
from hapo_megatron.parallel.linear import HiddenStates, linear_logprobs_entropy, logprobs_entropy_from_hidden
from hapo_megatron.parallel.loss import (
    hapo_loss_from_logits,
    logprobs_entropy_from_logits,
    make_logprob_func,
    make_loss_func,
)
from hapo_megatron.parallel.micro_batch import MicroBatch
from hapo_megatron.parallel.stats import (
    exact_global_sum,
    global_entropy_stats,
    global_sum,
    global_token_count,
)
from hapo_megatron.parallel.vocab_parallel import vocab_parallel_logprobs_entropy, vocab_range

__all__ = [
    "HiddenStates",
    "MicroBatch",
    "ParallelGroups",
    "all_gather_from_cp",
    "cp_chunk_indices",
    "cp_padded_length",
    "destroy_parallel",
    "exact_global_sum",
    "gather_from_cp",
    "get_parallel_groups",
    "global_entropy_stats",
    "global_sum",
    "global_token_count",
    "hapo_loss_from_logits",
    "initialize_parallel",
    "linear_logprobs_entropy",
    "logprobs_entropy_from_hidden",
    "logprobs_entropy_from_logits",
    "make_logprob_func",
    "make_loss_func",
    "split_for_cp",
    "vocab_parallel_logprobs_entropy",
    "vocab_range",
]
