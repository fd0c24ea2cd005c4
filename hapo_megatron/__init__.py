"""hapo_megatron: HAPO (Heterogeneous Adaptive Policy Optimization) on Megatron-Core.

The pure algorithm lives in `hapo_megatron.algo` (torch only); everything Megatron-aware lives in
`hapo_megatron.parallel`, `hapo_megatron.models` and `hapo_megatron.training`.
"""

__version__ = "0.1.0"
