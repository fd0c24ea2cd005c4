"""The embedded rollout engine on Hugging Face ``transformers`` (CPU default, small GPU runs).

A hand-written batched KV-cache sampler (clearer than ``model.generate`` for recording, per
sampled token, the log-prob under the exact sampling distribution and the temperature used):

1. prefill the left-padded prompts (``attention_mask`` + explicit ``position_ids``) into a
   ``DynamicCache``;
2. each step, for the last-position logits ``z`` ``[B, V]``:
   ``T = adaptive_temperature(z, stats, T_base, tau, h_hat_mode)`` per row (``T_base`` when not
   adaptive) -> ``z / T`` -> top-k -> top-p -> sample with a ``torch.Generator`` seeded from
   ``params.seed`` -> record ``log p(token)`` under that final distribution and ``T``;
3. stop a row on eos / ``stop_token_ids`` (``"stop"``) or ``max_new_tokens`` (``"length"``).

Greedy (``temperature == 0``): argmax of ``z``, log-prob ``log_softmax(z)``, temperature 0.
"""

from __future__ import annotations

import inspect
import os
import re
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from hapo_megatron.algo import adaptive_temperature
from hapo_megatron.rollout.engine import RowRequest, RowResult, Sample, SamplingParams, check_prompt_ids

# An MoE expert weight as exported (`mlp.experts.{e}.{gate,up,down}_proj.weight`).
_PER_EXPERT_NAME = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


# --------------------------------------------------------------------------- pure sampling math
def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the ``top_k`` largest entries of each row of ``logits`` ``[B, V]``; others -> -inf."""
    if top_k is None or top_k < 0 or top_k >= logits.shape[-1]:
        return logits
    vals, idx = torch.topk(logits, int(top_k), dim=-1)
    out = torch.full_like(logits, float("-inf"))
    return out.scatter(-1, idx, vals)


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter on ``logits`` ``[B, V]``: drop a token when the probability mass of the more
    likely tokens before it (in descending order) exceeds ``top_p``. The top token always stays."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before > top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sampling_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: int,
                      top_p: float) -> torch.Tensor:
    """Log-probs ``[B, V]`` (float32) of the final sampling distribution:
    ``log_softmax(top_p(top_k(logits / temperature)))``.

    Args:
        logits: ``[B, V]`` raw logits.
        temperature: ``[B]`` positive temperatures.
        top_k, top_p: the sampling's (``-1`` / ``1.0``: off).
    """
    z = logits.float() / temperature.float().unsqueeze(-1)
    z = apply_top_p(apply_top_k(z, top_k), top_p)
    return torch.log_softmax(z, dim=-1)


def step_temperatures(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[B]`` temperatures of one decoding step: adaptive (``hapo_megatron.algo``) or ``T_base``
    (then ``params.temperature_tau`` / ``h_hat_mode`` are not read: they may be None)."""
    if not params.uses_adaptive:
        return torch.full(logits.shape[:-1], float(params.temperature), dtype=torch.float32, device=logits.device)
    return adaptive_temperature(logits, params.entropy_stats, base_temperature=float(params.temperature),
                                temperature_tau=float(params.temperature_tau),
                                h_hat_mode=params.h_hat_mode)


def check_logits(logits: torch.Tensor, step: int) -> None:
    """Raise ``FloatingPointError`` on NaN logits or rows without any finite logit."""
    bad = torch.isnan(logits).any(dim=-1) | ~torch.isfinite(logits).any(dim=-1)
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise FloatingPointError(
            f"HFRolloutEngine: NaN or all-infinite logits at decoding step {step} in batch rows "
            f"{rows[:16]} (diverged weights? check the last update_weights / training step)")


def sample_step(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    Args:
        logits: ``[B, V]`` raw last-position logits.
    Returns:
        ``(tokens [B] int64, logprobs [B] float32, temperatures [B] float32)``.
    """
    if params.greedy:
        tokens = torch.argmax(logits, dim=-1)
        logp = torch.log_softmax(logits.float(), dim=-1)
        temps = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    else:
        temps = step_temperatures(logits, params)
        logp = sampling_logprobs(logits, temps, params.top_k, params.top_p)
        tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), temps


def _eos_ids(*sources: Any) -> set[int]:
    out: set[int] = set()
    for v in sources:
        if v is None:
            continue
        out.update(int(x) for x in (v if isinstance(v, (list, tuple, set)) else [v]) if x is not None)
    return out


class RouteRecorder:
    """The experts every MoE router of a transformers model chooses (forward hooks on the
    ``mlp.gate`` routers, which return ``(logits, weights, indices)``), one ``[B, T, L * k]`` int16
    tensor per model call (`end_call`); dense layers hold 0, as SGLang's routes do."""

    def __init__(self, model: torch.nn.Module) -> None:
        layers = model.model.layers
        self.num_layers = len(layers)
        gates = [(i, layer.mlp.gate) for i, layer in enumerate(layers)
                 if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")]
        if not gates:
            raise ValueError("return_routes: the model has no MoE layers to record the routing of")
        self.top_k = int(model.config.num_experts_per_tok)
        self._chosen: dict[int, torch.Tensor] = {}
        self.calls: list[torch.Tensor] = []
        self._handles = [gate.register_forward_hook(self._hook(i)) for i, gate in gates]

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            indices = output[-1] if isinstance(output, tuple) else None
            if indices is None or indices.is_floating_point() or indices.shape[-1] != self.top_k:
                raise TypeError(f"layer {layer}'s router returns no top-{self.top_k} expert indices last "
                                "(a transformers version this engine does not know)")
            self._chosen[layer] = indices.detach()
        return hook

    def end_call(self, batch: int, length: int) -> None:
        out = torch.zeros(batch, length, self.num_layers, self.top_k, dtype=torch.int16)
        for layer, indices in self._chosen.items():
            out[:, :, layer] = indices.reshape(batch, length, self.top_k).to("cpu", torch.int16)
        self.calls.append(out.reshape(batch, length, -1))
        self._chosen = {}

    def routes_of_row(self, b: int, prompt_len: int, response_len: int) -> torch.Tensor:
        """Row ``b``'s ``[prompt + response - 1, L * k]``: its prompt positions of the (left-padded)
        prefill call, then the response tokens fed back one call each (the last one never is)."""
        prefill, decoded = self.calls[0], self.calls[1:response_len]
        return torch.cat([prefill[b, prefill.shape[1] - prompt_len:]] + [c[b] for c in decoded])

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


# --------------------------------------------------------------------------- the engine
class HFRolloutEngine:
    """A :class:`~hapo_megatron.rollout.engine.RolloutEngine` on a ``transformers`` causal LM.

    Args:
        hf_config_or_path: a model directory (``from_pretrained``), a transformers config (random
            weights, to be replaced by :meth:`update_weights`) or a ``PreTrainedModel``.
        tokenizer: optional; its ``eos_token_id`` / ``pad_token_id`` are used.
        device, dtype: where and in which dtype the model lives.
        max_batch_size: sequences decoded together (prompts x n are split into chunks).
        attn_implementation: passed to transformers (default: its own choice, usually ``sdpa``).
    """

    def __init__(self, hf_config_or_path: Any, *, tokenizer: Any = None, device: Any = "cpu",
                 dtype: torch.dtype = torch.float32, max_batch_size: int = 64,
                 attn_implementation: Optional[str] = None) -> None:
        if int(max_batch_size) < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_batch_size = int(max_batch_size)
        self.tokenizer = tokenizer
        self.model = self._load_model(hf_config_or_path, attn_implementation)
        # transformers >= 5.24 names the KV cache `cache` (input and output) and warns at every run
        # on the older `past_key_values`, which earlier releases alone accept: ask the model which
        # (docs/troubleshooting.md, "Warnings")
        self._cache_name = "cache" if "cache" in inspect.signature(self.model.forward).parameters \
            else "past_key_values"
        gen_cfg = getattr(self.model, "generation_config", None)
        self.eos_token_ids = _eos_ids(getattr(tokenizer, "eos_token_id", None),
                                      getattr(gen_cfg, "eos_token_id", None),
                                      getattr(self.model.config, "eos_token_id", None))
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.model.config, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else 0
        self._released = False
        self._weight_version: Optional[int] = None  # reported per token once an update names one
        # the loop's stop check: not polled (generation runs in the caller's thread and the
        # synchronous loop asks it between rounds); every seed comes from SamplingParams.seed
        self.stop_check: Optional[Callable[[], bool]] = None
        self.send_sampling_seed = False

    def _load_model(self, src: Any, attn_implementation: Optional[str]) -> torch.nn.Module:
        import transformers

        kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
        if isinstance(src, torch.nn.Module):
            model = src
        elif isinstance(src, transformers.PretrainedConfig):
            model = transformers.AutoModelForCausalLM.from_config(src, **kw)
        elif isinstance(src, (str, os.PathLike)):
            model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=self.dtype, **kw)
        else:
            raise ValueError("hf_config_or_path must be a model directory, a transformers config or "
                             f"a torch.nn.Module, got {type(src).__name__}")
        model = model.to(device=self.device, dtype=self.dtype).eval()
        model.requires_grad_(False)
        return model

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 on_samples: Optional[Callable[[list[Sample]], None]] = None) -> list[list[Sample]]:
        """``params.n`` samples per prompt (see :class:`SamplingParams`), in prompt order;
        ``on_samples`` gets each batch of ``max_batch_size`` rows as it finishes.

        Deterministic for a fixed ``params.seed``, weights, prompts and ``max_batch_size``: one
        generator, seeded once, is consumed chunk by chunk in order.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        prompts = check_prompt_ids(prompt_ids)
        if self._released:
            raise RuntimeError("HFRolloutEngine.generate called after release_memory(); call resume_memory()")
        vocab = int(self.model.config.vocab_size)
        for i, p in enumerate(prompts):
            if max(p) >= vocab:
                raise ValueError(f"prompt_ids[{i}] has token id {max(p)} >= vocab_size {vocab}")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(seed))
        rows = [(p, k) for p in range(len(prompts)) for k in range(params.n)]
        out: list[list[Sample]] = [[] for _ in prompts]
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start:start + self.max_batch_size]
            results = self._decode([prompts[p] for p, _ in chunk], params, gen)
            done = [Sample(prompt_ids=list(prompts[p]), response_ids=resp, rollout_logprobs=logps,
                           temperatures=temps, finish_reason=reason, prompt_index=p, sample_index=k,
                           routed_experts=routes, weight_versions=self._versions(len(resp)))
                    for (p, k), (resp, logps, temps, reason, routes) in zip(chunk, results)]
            for smp in done:
                out[smp.prompt_index].append(smp)
            if on_samples is not None:
                on_samples(done)
        return out

    def _versions(self, num_tokens: int) -> Optional[list[int]]:
        return None if self._weight_version is None else [self._weight_version] * num_tokens

    def generate_group(self, rows: Sequence[RowRequest], params: SamplingParams) -> list[RowResult]:
        """Refused: over-sampling aborts and resumes server requests (config validation refuses it)."""
        raise NotImplementedError("HFRolloutEngine has no per-group abortable generation: over-sampling needs "
                                  "rollout.engine=sglang")

    def abort_requests(self) -> None:
        """No-op: nothing runs outside a `generate` call, which returns in the caller's thread."""

    def pause_generation(self, mode: str = "retract") -> None:
        """Refused: asynchronous rollouts need servers of their own (config validation refuses them)."""
        raise NotImplementedError("HFRolloutEngine cannot generate beside a weight update: asynchronous rollouts "
                                  "need rollout.engine=sglang")

    def continue_generation(self) -> None:
        """Refused, as :meth:`pause_generation`."""
        raise NotImplementedError("HFRolloutEngine cannot generate beside a weight update: asynchronous rollouts "
                                  "need rollout.engine=sglang")

    def spread_calls(self, enabled: bool = True) -> None:
        """No-op: one model in this process, nothing to spread calls over."""

    def fault_metrics(self) -> dict[str, float]:
        """{}: an in-process model has no server to lose."""
        return {}

    def check_health(self) -> None:
        """Raise when the model is gone (after :meth:`shutdown`)."""
        if self.model is None:
            raise RuntimeError("HFRolloutEngine was shut down")

    def _prefill_inputs(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded ``input_ids``, ``attention_mask`` and ``position_ids``, each ``[B, L]``."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[b, width - len(p):] = 1
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        return ids.to(self.device), mask.to(self.device), pos.to(self.device)

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        return set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)

    def _decode(self, prompts: list[list[int]], params: SamplingParams, gen: torch.Generator):
        """Decode one chunk; returns ``[(response_ids, logprobs, temperatures, finish_reason,
        routed_experts or None)]``."""
        recorder = RouteRecorder(self.model) if params.return_routes else None
        try:
            rows = self._decode_rows(prompts, params, gen, recorder)
        finally:
            if recorder is not None:
                recorder.remove()
        if recorder is None:
            return [row + (None,) for row in rows]
        return [row + (recorder.routes_of_row(b, len(p), len(row[0])).numpy(),)
                for b, (p, row) in enumerate(zip(prompts, rows))]

    def _decode_rows(self, prompts, params, gen, recorder: Optional[RouteRecorder]):
        from transformers import DynamicCache

        ids, mask, pos = self._prefill_inputs(prompts)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{self._cache_name: DynamicCache(config=self.model.config)})
        if recorder is not None:
            recorder.end_call(*ids.shape)
        next_pos = pos[:, -1] + 1
        stop_ids = self._stop_ids(params)
        n_rows = len(prompts)
        resp: list[list[int]] = [[] for _ in range(n_rows)]
        logps: list[list[float]] = [[] for _ in range(n_rows)]
        temps: list[list[float]] = [[] for _ in range(n_rows)]
        reasons: list[Optional[str]] = [None] * n_rows
        for step in range(params.max_new_tokens):
            logits = out.logits[:, -1, :]
            check_logits(logits, step)
            tokens, lp, tt = sample_step(logits, params, gen)
            for b, (t, l, T) in enumerate(zip(tokens.tolist(), lp.tolist(), tt.tolist())):
                if reasons[b] is not None:
                    continue
                resp[b].append(t)
                logps[b].append(l)
                temps[b].append(T)
                if t in stop_ids:
                    reasons[b] = "stop"
                elif len(resp[b]) >= params.max_new_tokens:
                    reasons[b] = "length"
            if all(r is not None for r in reasons):
                break
            # finished rows keep decoding a dummy token: simpler than pruning the cache
            mask = torch.cat([mask, mask.new_ones((n_rows, 1))], dim=1)
            out = self.model(input_ids=tokens.unsqueeze(-1), attention_mask=mask,
                             position_ids=next_pos.unsqueeze(-1), use_cache=True,
                             **{self._cache_name: getattr(out, self._cache_name)})
            if recorder is not None:
                recorder.end_call(n_rows, 1)
            next_pos = next_pos + 1
        return list(zip(resp, logps, temps, reasons))

    # ------------------------------------------------------------------ weights and memory
    def _param_groups(self) -> dict[str, list[str]]:
        """``name -> names sharing its storage`` for the model's state dict (tied weights)."""
        sd = self.model.state_dict()
        by_ptr: dict[tuple, list[str]] = {}
        for name, t in sd.items():
            by_ptr.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)), []).append(name)
        return {n: names for names in by_ptr.values() for n in names}

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       weight_version: Optional[int] = None, flush_cache: bool = True) -> None:
        """Copy HF-named full tensors into the model in place (dtype/device converted).
        ``weight_version``: reported per token by the samples generated after it
        (`Sample.weight_versions`); ``flush_cache``: nothing to flush (no cache between calls).

        All tensors are checked before anything is copied, so a bad update leaves the model
        unchanged. Raises ``ValueError`` listing unknown names, shape mismatches, duplicates and
        model tensors that were not provided (a tied weight counts as provided when any of its
        aliases is, e.g. ``lm_head.weight`` / ``model.embed_tokens.weight``).
        """
        items = list(named_tensors)  # read to the end first (the RolloutEngine contract)
        if any(_PER_EXPERT_NAME.search(name) for name, _ in items):
            # MoE: the export's per-expert (on-disk) names -> transformers' fused in-memory experts
            from hapo_megatron.convert.qwen3_moe import fused_expert_state
            items = list(fused_expert_state(dict(items)).items())
        sd = self.model.state_dict()
        groups = self._param_groups()
        unknown, bad_shape, dup, seen = [], [], [], set()
        for name, t in items:
            if not torch.is_tensor(t):
                raise ValueError(f"update_weights: {name!r} is a {type(t).__name__}, not a tensor")
            if name not in sd:
                unknown.append(name)
            elif tuple(t.shape) != tuple(sd[name].shape):
                bad_shape.append(f"{name}: got {tuple(t.shape)}, model has {tuple(sd[name].shape)}")
            if name in seen:
                dup.append(name)
            seen.add(name)
        missing = sorted(n for n in sd if not any(a in seen for a in groups[n]))
        if unknown or bad_shape or dup or missing:
            raise ValueError(
                "HFRolloutEngine.update_weights: name/shape mismatch (model unchanged)\n"
                f"  unknown names ({len(unknown)}): {unknown[:20]}\n"
                f"  shape mismatches ({len(bad_shape)}): {bad_shape[:20]}\n"
                f"  duplicates ({len(dup)}): {dup[:20]}\n"
                f"  missing model tensors ({len(missing)}): {missing[:20]}")
        for name, t in items:
            sd[name].copy_(t.detach())
        self._weight_version = None if weight_version is None else int(weight_version)

    def release_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """On CUDA, move the model to the CPU and empty the cache; a no-op on CPU. The model is
        this engine's one region (it keeps no KV cache between calls), so any ``tags`` release it."""
        if self.device.type == "cuda" and not self._released:
            self.model.to("cpu")
            torch.cuda.empty_cache()
            self._released = True

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Undo :meth:`release_memory` (any ``tags``: the model is one region)."""
        if self._released:
            self.model.to(self.device)
            self._released = False

    def shutdown(self) -> None:
        """Drop the model."""
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


__all__ = ["HFRolloutEngine", "RouteRecorder", "apply_top_k", "apply_top_p", "sampling_logprobs", "sample_step",
           "step_temperatures", "check_logits"]
