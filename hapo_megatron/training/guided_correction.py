"""EDGE-GRPO's guided error correction (GEC; Zhang et al., arXiv 2507.21848; docs/algorithm.md,
"EDGE-GRPO"), on rank 0 inside one synchronous generation round, before its batch is built.

Every wrong response of the round (``acc`` false) takes one of three branches, drawn from the
round's sampling seed and the response's position in the round (never from a rank or the
engine's state), as EDGE-GRPO's ``grpo_aha_trainer.py`` draws them:

- ``reflect`` (``algo.edge_gec_reflect_prob``): the response without its stop token, the cue
  (``algo.edge_gec_cue``), then the policy continues for up to ``algo.edge_gec_max_new_tokens``;
- ``solution`` (else, ``algo.edge_gec_solution_prob``): the row's reference solution
  (``extra_info[algo.edge_gec_solution_key]``) replaces the response;
- ``hint`` (else): the response, then ``algo.edge_gec_hint`` with the ground truth.

The corrected responses are scored again and enter the group's advantage like any other (the
authors' code likewise rewards and normalises after the correction). Inserted tokens were
sampled by no engine: their rollout log-prob is 0 and the row's temperatures are left to the
trainer's recomputation (config validation refuses what needs the engine's values). A
correction that would not fit ``rollout.max_response_length`` is skipped (``gec/skipped_frac``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from hapo_megatron.rollout.engine import Sample

REFLECT, HINT, SOLUTION = "reflect", "hint", "solution"
_GEC_STREAM = 0x6EC  # separates these draws from any other use of the round's seed

__all__ = ["REFLECT", "HINT", "SOLUTION", "GecCounts", "branch_of", "continuation_seed", "correct_round"]


def continuation_seed(seed: int) -> int:
    """The sampling seed of the reflections' continuations in the round with ``seed``: derived
    from it, apart from every round's own seed (those are consecutive integers)."""
    return int(np.random.SeedSequence([int(seed), _GEC_STREAM]).generate_state(1)[0]) % (2**31 - 1)


def branch_of(seed: int, position: int, reflect_prob: float, solution_prob: float) -> str:
    """The branch of the wrong response at ``position`` (group-major) of the round with ``seed``:
    a pure function of both, so a rerun or another layout corrects the same responses the same way."""
    u = np.random.default_rng([int(seed), _GEC_STREAM, int(position)]).random(2)
    if u[0] < reflect_prob:
        return REFLECT
    return SOLUTION if u[1] < solution_prob else HINT


@dataclasses.dataclass
class GecCounts:
    """Counts over a step's generation rounds, for the ``gec/*`` metrics."""

    responses: int = 0
    wrong: int = 0
    reflect: int = 0
    hint: int = 0
    solution: int = 0
    skipped: int = 0
    solution_missing: int = 0
    fixed: int = 0
    reflect_fixed: int = 0

    def metrics(self) -> dict[str, float]:
        """Fractions of all responses (``corrected_frac``: replaced by a correction), and the share
        of corrections (of reflections) that the reward then finds correct."""
        n = max(self.responses, 1)
        corrected = self.reflect + self.hint + self.solution
        return {"gec/wrong_frac": self.wrong / n, "gec/corrected_frac": corrected / n,
                "gec/reflect_frac": self.reflect / n, "gec/hint_frac": self.hint / n,
                "gec/solution_frac": self.solution / n, "gec/skipped_frac": self.skipped / n,
                "gec/solution_missing": float(self.solution_missing),
                "gec/fixed_frac": self.fixed / max(corrected, 1),
                "gec/reflect_fixed_frac": self.reflect_fixed / max(self.reflect, 1)}


def _without_stop(smp: Sample, stop_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The response's ids and log-probs without its final stop token (the authors decode with
    special tokens skipped before appending)."""
    ids, lps = smp.response_ids, smp.rollout_logprobs
    if smp.finish_reason == "stop" and len(ids) and int(ids[-1]) in set(stop_ids):
        return ids[:-1], lps[:-1]
    return ids, lps


def _corrected(smp: Sample, ids: Sequence[np.ndarray], lps: Sequence[np.ndarray], finish_reason: str) -> Sample:
    return Sample(prompt_ids=smp.prompt_ids, response_ids=np.concatenate(ids).astype(np.int32),
                  rollout_logprobs=np.concatenate(lps).astype(np.float32), temperatures=[],
                  finish_reason=finish_reason, prompt_index=smp.prompt_index, sample_index=smp.sample_index)


def correct_round(samples: list[list[Sample]], results: list[list[Any]], records: Sequence[Any], *,
                  algo: Any, seed: int, max_response_length: int, stop_ids: Sequence[int],
                  encode: Callable[[str], list[int]],
                  continue_fn: Callable[[list[list[int]], int], list[Sample]],
                  score_fn: Callable[[list[list[Sample]], list[Any]], list[list[Any]]],
                  counts: GecCounts) -> tuple[list[list[Sample]], list[list[Any]]]:
    """``samples[p][k]`` / ``results[p][k]`` with every wrong response corrected (module doc).

    ``algo``: the ``algo`` config section (the ``edge_gec_*`` fields); ``encode``: text -> token ids
    without special tokens; ``continue_fn(inputs, max_new_tokens)``: one policy sample per input
    (prompt + response + cue), in order; ``score_fn(samples, records)``: results per
    ``samples[j][0]`` against ``records[j]``. Returns new lists; the given ones are not changed."""
    samples = [list(g) for g in samples]
    results = [list(g) for g in results]
    n = len(samples[0]) if samples else 0
    eos = np.asarray(list(stop_ids)[:1], np.int32)
    cue = np.asarray(encode(algo.edge_gec_cue), np.int32)
    reflect_rows, new = [], {}  # (p, k, prefix ids, prefix log-probs); (p, k) -> (Sample, branch)
    for p, group in enumerate(samples):
        counts.responses += len(group)
        for k, smp in enumerate(group):
            if results[p][k].acc:
                continue
            counts.wrong += 1
            branch = branch_of(seed, p * n + k, algo.edge_gec_reflect_prob, algo.edge_gec_solution_prob)
            ids, lps = _without_stop(smp, stop_ids)
            extra = records[p].extra_info or {}
            solution = extra.get(algo.edge_gec_solution_key) if isinstance(extra, dict) else None
            if branch == SOLUTION and not solution:
                counts.solution_missing += 1
                branch = HINT
            if branch == REFLECT:
                if len(ids) + len(cue) + 1 > max_response_length:  # room for at least one new token
                    counts.skipped += 1
                    continue
                reflect_rows.append((p, k, np.concatenate([ids, cue]), np.concatenate([lps, np.zeros(len(cue))])))
                continue
            if branch == HINT:
                hint = np.asarray(encode(algo.edge_gec_hint.replace("{answer}", str(records[p].ground_truth))),
                                  np.int32)
                parts = [ids, hint, eos]
                lp_parts = [lps, np.zeros(len(hint) + len(eos))]
            else:
                sol = np.asarray(encode(str(solution)), np.int32)
                parts, lp_parts = [sol, eos], [np.zeros(len(sol) + len(eos))]
            if sum(len(x) for x in parts) > max_response_length:
                counts.skipped += 1
                continue
            new[(p, k)] = (_corrected(smp, parts, lp_parts, "stop" if len(eos) else "length"), branch)
    if reflect_rows:
        # one sample per row at the full budget, each cut to its own room: the first m tokens of a
        # sample are distributed as a sample of at most m tokens
        outs = continue_fn([samples[p][k].prompt_ids.tolist() + pre.tolist() for p, k, pre, _ in reflect_rows],
                           int(algo.edge_gec_max_new_tokens))
        for (p, k, pre, pre_lp), out in zip(reflect_rows, outs):
            room = max_response_length - len(pre)
            cont, cont_lp = out.response_ids[:room], out.rollout_logprobs[:room]
            finish = out.finish_reason if len(out.response_ids) <= room else "length"
            new[(p, k)] = (_corrected(samples[p][k], [pre, cont], [pre_lp, cont_lp], finish), REFLECT)
    if not new:
        return samples, results
    keys = sorted(new)
    renumbered = [[dataclasses.replace(new[key][0], prompt_index=j, sample_index=0)] for j, key in enumerate(keys)]
    scored = score_fn(renumbered, [records[p] for p, _ in keys])
    for (p, k), res in zip(keys, scored):
        smp, branch = new[(p, k)]
        samples[p][k], results[p][k] = smp, res[0]
        setattr(counts, branch, getattr(counts, branch) + 1)
        counts.fixed += bool(res[0].acc)
        counts.reflect_fixed += bool(res[0].acc) and branch == REFLECT
    return samples, results
