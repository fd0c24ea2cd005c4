#!/usr/bin/env bash
# Several nodes: run this on EVERY node with the same NNODES / MASTER_ADDR / RUN_ID.
#   NNODES=2 MASTER_ADDR=node0.example MASTER_PORT=29500 RUN_ID=hapo1 bash examples/qwen3-30b-a3b/train_multinode.sh \
#       trainer.run_dir=/shared/runs/hapo_qwen3-30b-a3b
# torchrun's c10d rendezvous assigns the node ranks; trainer.run_dir must be on a shared file system.
# The layout (TP2 x PP2 x EP8, ETP1) needs a multiple of 16 GPUs: 2 nodes of 8 (DP 4), 4 nodes (DP 8), ...
# Every node runs its own SGLang servers (config: num_servers 0 = GPUs / server_tp_size = 2 TP4/EP4
# servers per node), started by its first rank; rank 0 routes over all of them (docs/multinode.md).
: "${NNODES:?set NNODES}"
exec bash "$(dirname "$0")/../launch.sh" "examples/qwen3-30b-a3b/config.yaml" "$@"
