"""A step's data, from scored rollout to micro-batches.

    rollout_batch   `RolloutBatch`: samples -> scored batch -> shaped rewards -> dynamic-sampling
                    filter -> per-sequence advantages
    rollout_share   each rank's share of the kept rollout (`SequenceMeta`, `RankBatch`, the plan)
    route_share     the MoE routes each rank receives (its share, its pipeline stage's layers)
    ragged          rows of different lengths as one flat array plus offsets
    micro_batches   per-sequence data -> micro-batches balanced across data-parallel ranks
"""
