"""Abort and resume (rollout/sglang/partial.py) against a REAL SGLang server (the session pool's
tiny model, known peaked weights pushed first): a long group aborted once a short one is in comes
back with finish reason abort and the tokens and log-probs it had; resumed from prompt + partial
response with the remaining budget, it continues the same greedy response, token for token and
log-prob for log-prob, as transformers computes it for the whole response.

Mutation tried: `parse_row` keeping no tokens of an aborted row fails it (the partial response is
lost)."""

import torch

from hapo_megatron.rollout.engine import SamplingParams
from hapo_megatron.rollout.sglang.partial import ABORT, RowRequest, generate_groups

from .real_sglang import hf_greedy
from .test_sglang_real import make_engine, peaked_model

PROMPT = [1, 10, 11, 12, 13]
BUDGET = 48


def reference_logprobs(model, prompt, response):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        z = model(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) - 1 + len(response)].double()
    return torch.log_softmax(z, dim=-1).gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1)


def test_abort_then_resume_continues_the_same_response(real_server, real_api_key, real_model_dir):
    model = peaked_model(real_model_dir)
    eng = make_engine(real_server.url, real_api_key)
    eng.update_weights(iter(model.state_dict().items()))  # known weights, whatever ran before
    params = SamplingParams(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=BUDGET, ignore_eos=True)
    groups = [[RowRequest(tuple(PROMPT), 1)], [RowRequest(tuple(PROMPT), BUDGET)]]
    heard = []

    def on_group(g, rows):
        heard.append(g)
        return g == 0  # the short group is enough: the long one is aborted
    got = generate_groups(eng, groups, [params, params], on_group)
    assert heard[0] == 0 and sorted(heard) == [0, 1]
    (long_row,) = got[1]
    assert long_row.finish_reason == ABORT
    partial = list(long_row.token_ids)
    assert 0 < len(partial) < BUDGET and len(long_row.logprobs) == len(partial)

    def resume(g, rows):
        return False
    (rest,) = generate_groups(eng, [[RowRequest(tuple(PROMPT + partial), BUDGET - len(partial))]], [params],
                              resume)[0]
    assert rest.finish_reason == "length" and len(partial) + len(rest.token_ids) == BUDGET
    response = partial + list(rest.token_ids)
    assert response == hf_greedy(model, [PROMPT], BUDGET)[0]
    logprobs = torch.tensor(list(long_row.logprobs) + list(rest.logprobs), dtype=torch.float64)
    want = reference_logprobs(model, PROMPT, response)
    assert torch.allclose(logprobs, want, atol=1e-4, rtol=0), float((logprobs - want).abs().max())
