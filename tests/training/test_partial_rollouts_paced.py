"""Over-sampling end to end over HTTP: the rollout stage (`stages.generate_step`) with the SGLang
engine against the paced stand-in with heavy-tailed lengths (tools/bench/paced_sglang_server.py
``--length-median``: lognormal, capped; it aborts on ``/abort_request`` and continues a response
sent back as prompt + partial). Whole groups, none dropped, every trained response equal to the
one the server generates for that row in one piece, the mask of mask_prefix as long as the
response and zero exactly on the tokens of older versions.

Mutations tried: a resume sending the partial response less its last token fails the comparison
with the uninterrupted responses; `PartialRow.extend` dropping an aborted row's tokens (the row
starts over, which this stand-in answers with the same response) fails the ``rollout/resumed``
check."""

import numpy as np

from hapo_megatron.rollout.engine import SamplingParams
from hapo_megatron.rollout.sglang.engine import row_seeds
from hapo_megatron.rollout.sglang.partial import RowRequest, generate_groups
from hapo_megatron.training.partial_rollouts import PartialPool
from tests.tools._load import load_tool

B, N, MAX_LEN, STEPS = 3, 3, 48, 4


def test_heavy_tails_over_http(tmp_path):
    servers, bench = load_tool("bench/async_rollout"), load_tool("bench/oversampling")
    # 300 tokens/s: a capped row takes 160 ms, far longer than an abort's round trip, so every step
    # aborts the groups still running (2-4 a step); at 3000/s a quiet machine finished them all first
    procs, urls = servers.start_servers(1, 300.0, str(tmp_path), extra=[["--length-median", "6"]])
    try:
        rt = bench.build_rt(urls[0], over_sampling=2.0, batch=B, n=N, max_len=MAX_LEN, partial_mode="mask_prefix")
        got = bench.run_steps(rt, STEPS)
        seed_params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, seed=rt.sampling_seed(0, 0))
        rows, want = [], []
        for r in got:
            kept = r["kept"]
            for i, g in enumerate(kept.group_ids):
                seed = row_seeds(seed_params, [int(g) * N + i % N])[0]
                rows.append(kept.response_ids[i].tolist())
                want.append([RowRequest(tuple(kept.prompt_ids[i].tolist()), MAX_LEN, seed)])
        plain = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=MAX_LEN)
        whole = generate_groups(rt.engine, want, [plain] * len(want), lambda g, res: False)
    finally:
        servers.stop_servers(procs)
    assert rows == [list(w[0].token_ids) for w in whole]  # resumed responses continue, unchanged
    metrics = [r["metrics"] for r in got]
    assert sum(m["rollout/aborted"] for m in metrics) > 0 and sum(m["rollout/resumed"] for m in metrics) > 0
    pool = PartialPool.from_dict(rt.rl.partial_rollouts)
    trained = [int(g) for r in got for g in dict.fromkeys(r["kept"].group_ids)]
    assert sorted(trained + [g.serial for g in pool.groups]) == list(range(pool.next_serial))
    older = 0
    for step, r in enumerate(got, start=1):
        kept = r["kept"]
        assert (np.unique(kept.group_ids, return_counts=True)[1] == N).all() and len(kept) == B * N
        mask = kept.column("token_mask")
        assert (mask.lengths == kept.response_lengths).all()
        for i in range(len(kept)):  # ones after zeros: only a prefix is older
            m = mask[i].tolist()
            assert m == sorted(m)
        older += int((mask.flat == 0).sum())
    assert older > 0
