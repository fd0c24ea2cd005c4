"""Real SGLang server on a tiny random Llama (GPU only; skipped without CUDA or a full SGLang).

Checks against an independent HF-transformers recomputation (float32, full forward):
- without the processor, the returned log-probs are ``log_softmax(z / T_base)``;
- with the adaptive-temperature processor, they are ``log_softmax(z / T)`` with
  ``T = adaptive_temperature(z, stats, T_base, tau)`` and differ from the plain ones;
- after ``update_weights`` (CUDA-IPC tensor sync, then disk sync), greedy outputs follow the new
  weights; release/resume memory keeps the server usable.
"""

import pytest
import torch
from tests.rollout.sglang.engines import sglang_engine
from hapo_megatron.algo.loss_config import PolicyLossConfig

pytestmark = pytest.mark.gpu

VOCAB = 512


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    pytest.importorskip("sgl_kernel")  # a full SGLang install, not the --no-deps CPU one
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=512, eos_token_id=2,
                                   max_position_embeddings=1024, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    a = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    a.save_pretrained(path)
    torch.manual_seed(1)
    b = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    return str(path), a.float().cuda().eval(), b.float().cuda().eval(), b


@pytest.fixture(scope="module")
def engine(tiny_models, tmp_path_factory):
    from hapo_megatron.rollout.sglang.launch import free_port

    eng = sglang_engine(model_path=tiny_models[0], num_servers=1, server_tp_size=1, colocate=True,
                       weight_sync="tensor", mem_fraction_static=0.3, port_base=free_port(),
                       launch_timeout_s=600, log_dir=str(tmp_path_factory.mktemp("logs")),
                       extra_server_args=["--disable-cuda-graph"])
    yield eng
    eng.shutdown()


def recompute(model, prompt, response):
    ids = torch.tensor([list(prompt) + list(response[:-1])], device="cuda")
    with torch.no_grad():
        return model(input_ids=ids).logits[0, len(prompt) - 1:].float()


def test_generate_with_and_without_adaptive_processor(engine, tiny_models):
    from hapo_megatron.algo import adaptive_temperature, compute_entropy_stats, token_entropy
    from hapo_megatron.rollout.engine import SamplingParams

    model = tiny_models[1]
    prompts = [[5, 6, 7, 8], [100, 200, 300]]
    with torch.no_grad():
        ent = token_entropy(model(input_ids=torch.randint(3, VOCAB, (4, 16), device="cuda")).logits, temperature=1.0)
    stats = compute_entropy_stats(ent, torch.ones_like(ent, dtype=torch.bool),
        entropy_pivot=PolicyLossConfig().entropy_pivot)
    plain = SamplingParams(n=4, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=12, ignore_eos=True)
    adaptive = plain.with_(adaptive=True, entropy_stats=stats, temperature_tau=0.9, h_hat_mode="signed")
    err_adapt_vs_base = []
    for params in (plain, adaptive):
        for group in engine.generate(prompts, params):
            for s in group:
                assert len(s.response_ids) == 12 and s.temperatures.tolist() == []
                logits = recompute(model, s.prompt_ids, s.response_ids)
                temp = adaptive_temperature(logits, stats if params.adaptive else None, 1.0, 0.9,
                    h_hat_mode=PolicyLossConfig().h_hat_mode)
                want = torch.log_softmax(logits / temp[:, None], -1).gather(
                    -1, torch.tensor(s.response_ids, dtype=torch.long, device="cuda")[:, None])
                got = torch.tensor(s.rollout_logprobs, device="cuda")
                assert torch.allclose(got, want.squeeze(-1), atol=0.05), (params.adaptive, got, want)
                if params.adaptive:
                    base = torch.log_softmax(logits, -1).gather(
                        -1, torch.tensor(s.response_ids, dtype=torch.long, device="cuda")[:, None])
                    err_adapt_vs_base.append(float((got - base.squeeze(-1)).abs().max()))
    assert max(err_adapt_vs_base) > 0.1  # the processor really changed the distribution


def test_weight_sync_tensor_then_disk_changes_outputs(engine, tiny_models):
    from hapo_megatron.rollout.engine import SamplingParams

    _, model_a, model_b, b_bf16 = tiny_models
    greedy = SamplingParams(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [100, 200, 300]]

    def hf_greedy(model, prompt):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(8):
                ids.append(int(model(input_ids=torch.tensor([ids], device="cuda")).logits[0, -1].argmax()))
        return ids[len(prompt):]

    before = [g[0].response_ids.tolist() for g in engine.generate(prompts, greedy)]
    engine.release_memory()
    engine.resume_memory()
    named = [(k, v.cuda()) for k, v in b_bf16.state_dict().items()]
    engine.update_weights(iter(named))
    after = [g[0].response_ids.tolist() for g in engine.generate(prompts, greedy)]
    assert after != before
    assert sum(x == y for p, a in zip(prompts, after) for x, y in zip(a, hf_greedy(model_b, p))) >= 12
    engine.weight_sync = "disk"
    engine.update_weights((k, v.float().cpu()) for k, v in model_a.state_dict().items())
    back = [g[0].response_ids.tolist() for g in engine.generate(prompts, greedy)]
    assert back == before
