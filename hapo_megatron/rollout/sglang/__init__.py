"""Rollouts on SGLang servers: everything only the SGLang engine uses.

    engine             `SGLangEngine`: the `RolloutEngine` on SGLang servers
    client             the HTTP client (timeouts, retries, health checks)
    processor          adaptive temperature through SGLang's `CustomLogitProcessor` hook
    launch             starting and stopping server processes
    placement          where a torchrun job's servers run
    node_servers       every node's servers, routed together by rank 0
    serve              `python -m hapo_megatron.rollout.sglang.serve`: servers of their own
    server_supervisor  which servers are in use, and the replacement of those that die
    weight_sync        bucketing and payloads of SGLang's weight-update endpoints
    api_key            the per-run API key of the servers
    fp8_serving        what an FP8 server needs before it starts
"""
