"""The algorithm's choice tuples, defined once.

The config sections validate against these, and the loss, the samplers and the engines check
their own arguments against the same tuples, so a mode added here is accepted everywhere and a
mode removed here is refused everywhere. """

ADV_ESTIMATORS = ("hapo", "grpo")
# advantages relative to the other responses of the prompt's group: a group of 1 gets advantage 0
GROUP_RELATIVE_ADV_ESTIMATORS = ("hapo", "grpo")
H_HAT_MODES = ("signed", "reference")
ENTROPY_STATS_SCOPES = ("global", "microbatch")
H_HAT_ENTROPIES = ("old", "current")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_LOSS_TYPES = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
OLD_LOGPROB_SOURCES = ("recompute", "rollout")
FILTER_GROUPS_METRICS = ("acc", "score")
# off-policy correction between the behaviour (engine) and proximal (old-log-prob pass) policies
ROLLOUT_IS_MODES = ("none", "token_tis", "token_mis", "seq_tis")
# the per-token objective (docs/algorithm.md, "The field's objectives"): the clipped PPO/HAPO
# surrogate, GSPO's and GMPO's sequence-level ratios, CISPO's clipped detached weight, SAPO's gate
POLICY_LOSSES = ("ppo", "gspo", "gmpo", "cispo", "sapo", "clip_cov", "kl_cov")
# objectives whose ratio is one per sequence (the sequence's mean token log-ratio)
SEQUENCE_RATIO_LOSSES = ("gspo", "gmpo")
# objectives that select tokens by their advantage x log-prob covariance (algo/cov.py)
COV_LOSSES = ("clip_cov", "kl_cov")
# over which tokens Clip-Cov / KL-Cov take their statistics: the step batch on every rank, or
# each micro-batch on its rank (verl)
COV_SCOPES = ("step", "micro_batch")
