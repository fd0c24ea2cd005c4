"""Run configuration: one dataclass per section, YAML files, dotted overrides and presets.

A config is built in this order (later wins):

1. the dataclass defaults below;
2. a preset (``PRESETS``; the ``preset`` argument, else a top-level ``preset:`` key in the YAML);
3. the YAML file;
4. dotted overrides such as ``algo.clip_ratio_high=0.28`` (values parsed with ``yaml.safe_load``).

Every field has a docstring right below it (``hapo config docs`` prints them) and every check
lives in ``__post_init__`` with a message that names the field. Values are coerced to the field
type (``"1e-6"`` -> ``1e-06`` for a float, ``"a.parquet"`` -> ``["a.parquet"]`` for a list), so a
config built from a dict, a YAML file or keyword arguments is always well typed.
Checks that need the model or the world size are left to the trainer, except
``ParallelConfig.validate_world``.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import os
import textwrap
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

import yaml

from hapo_megatron.presets import PRESETS, preset_overrides

__all__ = [
    "AlgoConfig", "RewardConfig", "DataConfig", "SGLangConfig", "RolloutConfig", "ModelConfig",
    "ParallelConfig", "OptimConfig", "TrainerConfig", "LoggingConfig", "HapoConfig",
    "PRESETS", "load_config", "save_config", "format_config", "apply_overrides",
    "parse_override", "field_docs",
]

ADV_ESTIMATORS = ("hapo", "grpo")
H_HAT_MODES = ("signed", "reference")
ENTROPY_STATS_SCOPES = ("global", "microbatch")
H_HAT_ENTROPIES = ("old", "current")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_LOSS_TYPES = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
OLD_LOGPROB_SOURCES = ("recompute", "rollout")
FILTER_GROUPS_METRICS = ("acc", "score")
SCORE_FORMATS = ("pm1", "01")
ROLLOUT_ENGINES = ("hf", "sglang")
WEIGHT_SYNC_MODES = ("auto", "tensor", "distributed", "disk")
DTYPES = ("bf16", "fp16", "fp32")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
WANDB_MODES = ("offline", "online", "disabled")


# ----------------------------------------------------------------------------- checks


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        _fail(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def _check_min(name: str, value: Optional[float], lo: float, *, strict: bool = False) -> None:
    """value >= lo (value > lo when strict); None passes (optional fields)."""
    if value is None:
        return
    if (value <= lo) if strict else (value < lo):
        _fail(f"{name} must be {'>' if strict else '>='} {lo}, got {value}")


def _check_open_unit(name: str, value: float, *, right_closed: bool = False) -> None:
    ok = 0 < value <= 1 if right_closed else 0 < value < 1
    if not ok:
        _fail(f"{name} must be in (0, 1{']' if right_closed else ')'}, got {value}")


# ----------------------------------------------------------------------------- type coercion


def _type_name(tp: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    if tp in names:
        return names[tp]
    if typing.get_origin(tp) is list:
        return "a list"
    return f"a {getattr(tp, '__name__', None) or str(tp).replace('typing.', '')}"


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Coerce ``value`` to the annotated type ``tp`` or raise ValueError naming ``name``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if len(args) == 1:
            try:
                return _coerce(value, args[0], name)
            except ValueError:
                _fail(f"{name} must be {_type_name(args[0])} or null, got {value!r}")
        return value
    if origin is list:
        (elem,) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            value = [value]  # `data.train_files=a.parquet` means a one-element list
        if not isinstance(value, (list, tuple)):
            _fail(f"{name} must be a list, got {value!r}")
        return [_coerce(v, elem, f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            _fail(f"{name} must be a mapping, got {value!r}")
        return dict(value)
    if isinstance(tp, type) and issubclass(tp, _Section):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            _fail(f"{name} must be a mapping of {tp._path} fields, got {value!r}")
        return tp.from_dict(value)
    return _coerce_scalar(value, tp, name)


def _coerce_scalar(value: Any, tp: type, name: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        _fail(f"{name} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            _fail(f"{name} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        _fail(f"{name} must be an integer, got {value!r}")
    if tp is float:
        out = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out = float(value)
        elif isinstance(value, str):  # PyYAML reads `1e-6` (no dot) as a string
            try:
                out = float(value.strip())
            except ValueError:
                pass
        if out is None:
            _fail(f"{name} must be a number, got {value!r}")
        if not math.isfinite(out):
            _fail(f"{name} must be finite, got {value!r}")
        return out
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        _fail(f"{name} must be a string, got {value!r}")
    raise TypeError(f"config field {name} has unsupported type {tp!r}")


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a config dataclass: ``{field_name: docstring}``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _unknown_key_error(cls: type, key: str, where: str = "") -> ValueError:
    names = [f.name for f in dataclasses.fields(cls)]
    path = f"{cls._path}.{key}" if cls._path else key
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    section = f"section {cls._path!r}" if cls._path else "the top level"
    return ValueError(f"unknown config key {path!r}{hint}{where}; valid keys of {section}: "
                      f"{', '.join(names)}")


class _Section:
    """Base of every config section: coercion + validation on construction, dict round trip."""

    _path: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            name = f"{self._path}.{f.name}" if self._path else f.name
            setattr(self, f.name, _coerce(getattr(self, f.name), hints[f.name], name))
        self._validate()

    def _validate(self) -> None:
        """Section checks; overridden by sections that have any."""

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON safe) of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Optional[dict[str, Any]]):
        """Build from a (possibly partial) dict; unknown keys raise ValueError listing valid ones."""
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)}
        for key in d:
            if key not in names:
                raise _unknown_key_error(cls, str(key))
        return cls(**d)


# ----------------------------------------------------------------------------- sections


@dataclass
class AlgoConfig(_Section):
    """The policy-optimisation algorithm: HAPO's four switches, the DAPO/GRPO knobs, the loss."""

    _path: ClassVar[str] = "algo"

    adv_estimator: str = "hapo"
    """Advantage estimator: "hapo" (token-level group average, TLGA) or "grpo" (per response)."""
    norm_adv_by_std: bool = True
    """Divide advantages by the group std; false gives Dr.GRPO (grpo) / mean-centred TLGA."""
    tlga_fallback_threshold: float = 5.0
    """A TLGA group falls back to GRPO advantages when any valid token has |A| >= this."""
    adaptive_temperature: bool = True
    """HAPO component: per-token sampling temperature T = T_base * (1 + tau * h_hat)."""
    temperature_tau: float = 0.05
    """tau of the adaptive temperature; in [0, 1) so the temperature stays positive."""
    entropy_pivot: float = 0.8
    """Quantile q of the log-entropies used as the pivot of h_hat (tokens above are "high")."""
    h_hat_mode: str = "signed"
    """"signed" (the paper: h_hat < 0 for low entropy) or "reference" (the public code's sign defect)."""
    entropy_stats_scope: str = "global"
    """Entropy statistics over the whole step batch on all ranks ("global") or per micro-batch."""
    h_hat_entropy: str = "old"
    """Which entropy feeds h_hat in the loss: of the rollout policy ("old") or the current one."""
    adaptive_clip: bool = True
    """HAPO component: asymmetric adaptive clipping (entropy-dependent clip ranges)."""
    clip_alpha: float = 1.0
    """Strength of the adaptive clip widening (>= 0)."""
    adaptive_advantage: bool = True
    """HAPO component: differential advantage redistribution by entropy and importance ratio."""
    adv_beta: float = 1.0
    """Strength of the advantage redistribution (>= 0): A_ent = A * (1 + adv_beta * h_hat)."""
    clip_ratio_low: float = 0.2
    """eps_L: the ratio is clipped below at 1 - eps_L."""
    clip_ratio_high: float = 0.2
    """eps_R: the ratio is clipped above at 1 + eps_R (DAPO clip-higher uses 0.28)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound c (> 1) for negative advantages (the paper's recipe uses 10.0)."""
    loss_agg_mode: str = "token-mean"
    """Loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm."""
    kl_loss_coef: float = 0.0
    """Coefficient of the KL penalty against the reference model (0 = off, no reference model)."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator: k1 (kl), k2 (mse), k3 (low_var_kl, clamped), abs."""
    entropy_coeff: float = 0.0
    """Coefficient of the entropy bonus (0 = off)."""
    old_logprob_source: str = "recompute"
    """Old log-probs from a Megatron forward pass ("recompute") or as reported by the rollout engine."""
    tis_cap: Optional[float] = None
    """Truncated importance sampling cap on pi_old / pi_rollout (null = no correction)."""
    filter_groups: bool = False
    """DAPO dynamic sampling: drop groups whose responses all got the same metric value."""
    filter_groups_metric: str = "acc"
    """Metric that dynamic sampling compares within a group: "acc" or "score"."""
    max_num_gen_batches: int = 16
    """Dynamic sampling stops after this many generation batches even if the batch is not full."""

    def _validate(self) -> None:
        p = self._path
        _check_choice(f"{p}.adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        _check_min(f"{p}.tlga_fallback_threshold", self.tlga_fallback_threshold, 0.0, strict=True)
        if not 0 <= self.temperature_tau < 1:
            _fail(f"{p}.temperature_tau must be in [0, 1), got {self.temperature_tau}")
        _check_open_unit(f"{p}.entropy_pivot", self.entropy_pivot)
        _check_choice(f"{p}.h_hat_mode", self.h_hat_mode, H_HAT_MODES)
        _check_choice(f"{p}.entropy_stats_scope", self.entropy_stats_scope, ENTROPY_STATS_SCOPES)
        _check_choice(f"{p}.h_hat_entropy", self.h_hat_entropy, H_HAT_ENTROPIES)
        for name in ("clip_alpha", "adv_beta", "clip_ratio_low", "clip_ratio_high", "kl_loss_coef"):
            _check_min(f"{p}.{name}", getattr(self, name), 0.0)
        _check_min(f"{p}.clip_ratio_c", self.clip_ratio_c, 1.0, strict=True)
        _check_choice(f"{p}.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _check_choice(f"{p}.kl_loss_type", self.kl_loss_type, KL_LOSS_TYPES)
        _check_choice(f"{p}.old_logprob_source", self.old_logprob_source, OLD_LOGPROB_SOURCES)
        _check_min(f"{p}.tis_cap", self.tis_cap, 0.0, strict=True)
        _check_choice(f"{p}.filter_groups_metric", self.filter_groups_metric, FILTER_GROUPS_METRICS)
        _check_min(f"{p}.max_num_gen_batches", self.max_num_gen_batches, 1)


@dataclass
class RewardConfig(_Section):
    """The outcome reward and DAPO's overlong reward shaping."""

    _path: ClassVar[str] = "reward"

    reward_fn: str = "math"
    """A registered reward name ("math") or a dotted path "pkg.module:function"."""
    score_format: str = "pm1"
    """Score of the math reward: "pm1" (+1 correct / -1 otherwise, DAPO) or "01"."""
    reward_kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments passed to the reward function."""
    overlong_buffer_enable: bool = False
    """DAPO overlong shaping: penalise responses that enter the last overlong_buffer_len tokens."""
    overlong_buffer_len: int = 4096
    """Length B of the overlong buffer (tokens); must be < rollout.max_response_length when on."""
    overlong_penalty_factor: float = 1.0
    """The penalty grows linearly to -overlong_penalty_factor at the maximum response length."""

    def _validate(self) -> None:
        if not self.reward_fn.strip():
            _fail("reward.reward_fn must be a reward name or a dotted path, got ''")
        _check_choice("reward.score_format", self.score_format, SCORE_FORMATS)
        _check_min("reward.overlong_buffer_len", self.overlong_buffer_len, 1 if self.overlong_buffer_enable else 0)
        _check_min("reward.overlong_penalty_factor", self.overlong_penalty_factor, 0.0)


@dataclass
class DataConfig(_Section):
    """Prompt datasets (verl/DAPO parquet or JSONL layout) and batching of prompts."""

    _path: ClassVar[str] = "data"

    train_files: list[str] = field(default_factory=list)
    """Training prompt files (.parquet or .jsonl)."""
    val_files: list[str] = field(default_factory=list)
    """Validation prompt files; each row's data_source names its benchmark in the eval metrics."""
    prompt_key: str = "prompt"
    """Column holding the chat messages [{"role", "content"}, ...]."""
    max_prompt_length: int = 1024
    """Longest prompt in tokens; a longer prompt is an error when the dataset is loaded."""
    train_batch_size: int = 512
    """Prompts per training step (each gets rollout.n responses)."""
    val_max_samples: Optional[int] = None
    """Evaluate on at most this many prompts per validation file (null = all)."""
    shuffle: bool = True
    """Shuffle the training prompts every epoch (deterministic from seed and epoch)."""
    seed: int = 1
    """Seed of the prompt shuffling."""
    tokenizer_path: Optional[str] = None
    """Tokenizer directory or hub name; null means model.hf_model_path (filled in when the config
    is built, so the saved config is explicit)."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (when it has one); else join the contents."""

    def _validate(self) -> None:
        if not self.prompt_key:
            _fail("data.prompt_key must be a non-empty column name")
        _check_min("data.max_prompt_length", self.max_prompt_length, 1)
        _check_min("data.train_batch_size", self.train_batch_size, 1)
        _check_min("data.val_max_samples", self.val_max_samples, 1)


@dataclass
class SGLangConfig(_Section):
    """SGLang rollout servers (used when rollout.engine is "sglang")."""

    _path: ClassVar[str] = "rollout.sglang"

    server_urls: list[str] = field(default_factory=list)
    """Attach to running servers at these URLs; empty means launch num_servers servers."""
    num_servers: int = 1
    """Servers to launch (ignored when server_urls is set)."""
    server_tp_size: int = 1
    """Tensor-parallel size of each launched server."""
    mem_fraction_static: float = 0.7
    """SGLang's static GPU memory fraction (weights + KV cache), in (0, 1]."""
    weight_sync: str = "auto"
    """How weights reach the servers: auto, tensor (CUDA IPC, colocated), distributed (NCCL), disk."""
    bucket_size_mb: int = 512
    """Size of one weight-update bucket (MiB)."""
    request_timeout_s: float = 600.0
    """Timeout of one HTTP request to a server (seconds)."""
    max_retries: int = 3
    """Retries of a failed generate request before the step fails."""
    colocate: bool = True
    """Servers share the training GPUs (memory released/resumed around generation)."""
    use_router: bool = False
    """Send requests through an sglang-router instead of round-robin over the servers."""
    extra_server_args: list[str] = field(default_factory=list)
    """Extra command-line arguments for launched servers."""
    port_base: int = 30000
    """First port of launched servers (server i listens on port_base + i)."""

    def _validate(self) -> None:
        p = self._path
        for name in ("num_servers", "server_tp_size", "bucket_size_mb"):
            _check_min(f"{p}.{name}", getattr(self, name), 1)
        _check_open_unit(f"{p}.mem_fraction_static", self.mem_fraction_static, right_closed=True)
        _check_choice(f"{p}.weight_sync", self.weight_sync, WEIGHT_SYNC_MODES)
        _check_min(f"{p}.request_timeout_s", self.request_timeout_s, 0.0, strict=True)
        _check_min(f"{p}.max_retries", self.max_retries, 0)
        if not 1 <= self.port_base <= 65535 - self.num_servers:
            _fail(f"{p}.port_base must leave room for {self.num_servers} ports below 65536, got {self.port_base}")
        for i, url in enumerate(self.server_urls):
            if not url.startswith(("http://", "https://")):
                _fail(f"{p}.server_urls[{i}] must start with http:// or https://, got {url!r}")
        if self.weight_sync == "tensor" and not self.colocate:
            _fail(f"{p}.weight_sync='tensor' (CUDA IPC) needs {p}.colocate=true")


@dataclass
class RolloutConfig(_Section):
    """Response generation for training (adaptive temperature) and validation."""

    _path: ClassVar[str] = "rollout"

    engine: str = "hf"
    """Rollout engine: "hf" (embedded HF transformers, CPU / small GPU) or "sglang"."""
    n: int = 16
    """Responses per prompt (the group size)."""
    temperature: float = 1.0
    """T_base, the base sampling temperature (also the temperature of the training entropies)."""
    top_p: float = 1.0
    """Nucleus sampling threshold in (0, 1]."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    max_response_length: int = 10240
    """Maximum response length in tokens."""
    val_n: int = 8
    """Responses per prompt at validation (avg@val_n)."""
    val_temperature: float = 0.5
    """Fixed validation temperature (0 = greedy); validation never uses the adaptive temperature."""
    val_top_p: float = 0.7
    """Validation nucleus threshold."""
    generate_batch_size: Optional[int] = None
    """Prompts per generation round (null = data.train_batch_size); with dynamic sampling, rounds
    repeat until the batch is full."""
    hf_max_batch_size: int = 64
    """Sequences decoded together by the "hf" engine."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """SGLang server options."""

    def _validate(self) -> None:
        _check_choice("rollout.engine", self.engine, ROLLOUT_ENGINES)
        for name in ("n", "max_response_length", "val_n", "hf_max_batch_size"):
            _check_min(f"rollout.{name}", getattr(self, name), 1)
        _check_min("rollout.temperature", self.temperature, 0.0, strict=True)
        _check_min("rollout.val_temperature", self.val_temperature, 0.0)
        _check_open_unit("rollout.top_p", self.top_p, right_closed=True)
        _check_open_unit("rollout.val_top_p", self.val_top_p, right_closed=True)
        if self.top_k != -1 and self.top_k < 1:
            _fail(f"rollout.top_k must be -1 (off) or >= 1, got {self.top_k}")
        _check_min("rollout.generate_batch_size", self.generate_batch_size, 1)


@dataclass
class ModelConfig(_Section):
    """The policy model."""

    _path: ClassVar[str] = "model"

    hf_model_path: Optional[str] = None
    """HF checkpoint (directory or hub name) for the architecture, tokenizer and initial weights."""
    megatron_load_path: Optional[str] = None
    """Start from this Megatron checkpoint instead of converting the HF weights."""
    dtype: str = "bf16"
    """Training parameter dtype: bf16, fp16 or fp32 (CPU runs use fp32)."""
    use_te: Optional[bool] = None
    """Use Transformer Engine layers (null = when installed and CUDA is available)."""
    recompute_activations: bool = False
    """Full activation recomputation to save memory."""

    def _validate(self) -> None:
        _check_choice("model.dtype", self.dtype, DTYPES)


@dataclass
class ParallelConfig(_Section):
    """Megatron parallelism of the actor; data parallelism is what the world size leaves over."""

    _path: ClassVar[str] = "parallel"

    tensor_model_parallel_size: int = 1
    """Tensor parallel size (TP); must divide the attention heads (checked with the model)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline parallel size (PP)."""
    context_parallel_size: int = 1
    """Context parallel size (CP)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (ignored when TP == 1)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks."""
    micro_batch_size: int = 1
    """Sequences per micro-batch (when max_tokens_per_micro_batch is null)."""
    max_tokens_per_micro_batch: Optional[int] = None
    """Pack sequences into micro-batches of at most this many tokens (prompt + response)."""

    def _validate(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "context_parallel_size", "micro_batch_size"):
            _check_min(f"parallel.{name}", getattr(self, name), 1)
        _check_min("parallel.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, 1)

    @property
    def model_parallel_size(self) -> int:
        """tp * pp * cp: ranks holding one replica of the model."""
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                * self.context_parallel_size)

    def validate_world(self, world_size: int) -> int:
        """Check that ``world_size`` is divisible by tp * pp * cp; returns the DP size."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            _fail(f"world_size must be a positive integer, got {world_size!r}")
        mp = self.model_parallel_size
        if world_size % mp:
            _fail(f"world_size {world_size} is not divisible by parallel.tensor_model_parallel_size "
                  f"* pipeline_model_parallel_size * context_parallel_size = "
                  f"{self.tensor_model_parallel_size} * {self.pipeline_model_parallel_size} * "
                  f"{self.context_parallel_size} = {mp}")
        return world_size // mp


@dataclass
class OptimConfig(_Section):
    """Adam optimizer and learning-rate schedule."""

    _path: ClassVar[str] = "optim"

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate of the linear/cosine decay."""
    lr_warmup_steps: int = 10
    """Linear warm-up steps (optimizer steps)."""
    lr_decay_style: str = "constant"
    """Schedule after warm-up: constant, linear or cosine."""
    lr_decay_steps: Optional[int] = None
    """Optimizer steps of warm-up + decay (null = all optimizer steps of the run)."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1 in [0, 1)."""
    adam_beta2: float = 0.999
    """Adam beta2 in [0, 1)."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Gradient-norm clipping (0 = off)."""

    def _validate(self) -> None:
        _check_min("optim.lr", self.lr, 0.0, strict=True)
        if not 0 <= self.min_lr <= self.lr:
            _fail(f"optim.min_lr must be in [0, optim.lr={self.lr}], got {self.min_lr}")
        _check_min("optim.lr_warmup_steps", self.lr_warmup_steps, 0)
        _check_choice("optim.lr_decay_style", self.lr_decay_style, LR_DECAY_STYLES)
        _check_min("optim.lr_decay_steps", self.lr_decay_steps, 1)
        _check_min("optim.weight_decay", self.weight_decay, 0.0)
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                _fail(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        _check_min("optim.adam_eps", self.adam_eps, 0.0, strict=True)
        _check_min("optim.clip_grad", self.clip_grad, 0.0)


@dataclass
class TrainerConfig(_Section):
    """The training loop: steps, PPO updates, checkpoints, evaluation, naming."""

    _path: ClassVar[str] = "trainer"

    total_steps: int = 500
    """Training steps (one rollout batch each)."""
    ppo_mini_batch_size: int = 32
    """Prompts per PPO mini-batch (optimizer step); must divide data.train_batch_size."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    seed: int = 1
    """Seed of model init, sampling and everything else random in the trainer."""
    project_name: str = "hapo"
    """Project name (wandb project unless logging.wandb_project is set)."""
    experiment_name: str = "hapo_run"
    """Run name (default run_dir and wandb run name)."""
    run_dir: Optional[str] = None
    """Run directory (resolved config, metrics.jsonl, checkpoints); null = runs/<experiment_name>
    (filled in when the config is built)."""
    save_interval: int = 50
    """Save a checkpoint every this many steps (0 = only at the end)."""
    keep_last_k: Optional[int] = 3
    """Checkpoints to keep (null = all)."""
    resume: str = "auto"
    """"auto" (latest checkpoint in run_dir if any), "none", or a checkpoint path."""
    eval_interval: int = 0
    """Evaluate on data.val_files every this many steps (0 = never during training)."""
    val_before_train: bool = False
    """Evaluate once before the first step."""
    val_at_end: bool = True
    """Evaluate after the last step (when data.val_files is set)."""
    max_consecutive_skips: int = 5
    """Abort after this many consecutive skipped steps (no usable group or a non-finite loss)."""
    sft_warmup_steps: int = 0
    """Supervised warm-up steps on reference solutions before RL (the CPU example)."""

    def _validate(self) -> None:
        for name, lo in (("total_steps", 1), ("ppo_mini_batch_size", 1), ("ppo_epochs", 1),
                         ("save_interval", 0), ("keep_last_k", 1), ("eval_interval", 0),
                         ("max_consecutive_skips", 0), ("sft_warmup_steps", 0)):
            _check_min(f"trainer.{name}", getattr(self, name), lo)
        for name in ("project_name", "experiment_name", "resume"):
            if not getattr(self, name).strip():
                _fail(f"trainer.{name} must be a non-empty string")
        if self.run_dir is None:
            self.run_dir = os.path.join("runs", self.experiment_name)


@dataclass
class LoggingConfig(_Section):
    """Metric sinks: console, <run_dir>/metrics.jsonl, wandb, TensorBoard."""

    _path: ClassVar[str] = "logging"

    console: bool = True
    """Print a metrics line every log_interval steps."""
    jsonl: bool = True
    """Append metrics to <run_dir>/metrics.jsonl."""
    wandb: bool = False
    """Log to Weights & Biases."""
    wandb_mode: str = "offline"
    """wandb mode: offline, online or disabled."""
    wandb_project: Optional[str] = None
    """wandb project (null = trainer.project_name)."""
    wandb_entity: Optional[str] = None
    """wandb entity (null = your default)."""
    wandb_run_name: Optional[str] = None
    """wandb run name (null = trainer.experiment_name)."""
    tensorboard: bool = False
    """Write TensorBoard event files."""
    tensorboard_dir: Optional[str] = None
    """TensorBoard directory (null = <run_dir>/tensorboard)."""
    log_interval: int = 1
    """Log every this many steps."""

    def _validate(self) -> None:
        _check_choice("logging.wandb_mode", self.wandb_mode, WANDB_MODES)
        _check_min("logging.log_interval", self.log_interval, 1)


@dataclass
class HapoConfig(_Section):
    """The whole run configuration: one field per section."""

    _path: ClassVar[str] = ""

    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Algorithm (HAPO / DAPO / GRPO switches and the loss)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function and overlong shaping."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt datasets."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Megatron parallelism."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Training loop."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metric sinks."""

    def _validate(self) -> None:
        """Checks that span sections, then fill the defaults that point at other fields."""
        self._check_batching()
        self._check_rollout()
        if self.data.tokenizer_path is None:
            self.data.tokenizer_path = self.model.hf_model_path
        if self.logging.wandb_project is None:
            self.logging.wandb_project = self.trainer.project_name
        if self.logging.wandb_run_name is None:
            self.logging.wandb_run_name = self.trainer.experiment_name
        if self.logging.tensorboard_dir is None:
            self.logging.tensorboard_dir = os.path.join(self.trainer.run_dir, "tensorboard")

    def _check_batching(self) -> None:
        bsz, mini = self.data.train_batch_size, self.trainer.ppo_mini_batch_size
        if bsz % mini:
            _fail(f"data.train_batch_size ({bsz}) must be divisible by trainer.ppo_mini_batch_size ({mini})")
        seq_len = self.data.max_prompt_length + self.rollout.max_response_length
        budget = self.parallel.max_tokens_per_micro_batch
        if budget is not None and budget < seq_len:
            _fail(f"parallel.max_tokens_per_micro_batch ({budget}) must be >= data.max_prompt_length "
                  f"+ rollout.max_response_length ({seq_len}) so that every sequence fits")

    def _check_rollout(self) -> None:
        rw, ro, algo = self.reward, self.rollout, self.algo
        if rw.overlong_buffer_enable and rw.overlong_buffer_len >= ro.max_response_length:
            _fail(f"reward.overlong_buffer_len ({rw.overlong_buffer_len}) must be < "
                  f"rollout.max_response_length ({ro.max_response_length}) when "
                  "reward.overlong_buffer_enable is true")
        if algo.filter_groups and ro.n < 2:
            _fail(f"algo.filter_groups needs rollout.n >= 2 (a group of {ro.n} is always constant)")
        if ro.engine != "sglang" and ro.sglang.server_urls:
            _fail(f"rollout.sglang.server_urls is set but rollout.engine is {ro.engine!r}; "
                  "set rollout.engine=sglang")
        if algo.old_logprob_source == "rollout" and algo.adaptive_temperature:
            warnings.warn("algo.old_logprob_source='rollout' with algo.adaptive_temperature: the "
                          "rollout log-probs are under the adaptive temperatures, not T_base",
                          stacklevel=3)


# ----------------------------------------------------------------------------- loading


def _resolve_key(key: str, where: str = "") -> tuple[type, str]:
    """Check a dotted key against the schema; returns (owning section class, field name)."""
    parts = key.split(".")
    cls: type = HapoConfig
    for i, part in enumerate(parts):
        names = {f.name for f in dataclasses.fields(cls)}
        if part not in names:
            raise _unknown_key_error(cls, part, where)
        tp = _hints(cls)[part]
        is_section = isinstance(tp, type) and issubclass(tp, _Section)
        if i == len(parts) - 1:
            return cls, part
        if not is_section:
            _fail(f"config key {'.'.join(parts[:i + 1])!r} is a value, not a section{where}; "
                  f"cannot set {key!r}")
        cls = tp
    raise AssertionError("unreachable")


def _set_dotted(tree: dict, key: str, value: Any, where: str = "") -> None:
    _resolve_key(key, where)
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _flatten(tree: dict, cls: type = None, prefix: str = "") -> list[tuple[str, Any]]:
    """Dotted (key, value) pairs of a nested dict, descending only into config sections."""
    cls = cls or HapoConfig
    hints = _hints(cls)
    out = []
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        tp = hints.get(key)
        is_section = isinstance(tp, type) and issubclass(tp, _Section)
        if is_section and value is None:
            continue  # an empty `algo:` block in YAML
        if is_section and isinstance(value, dict):
            out.extend(_flatten(value, tp, dotted + "."))
        else:
            out.append((dotted, value))
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """``"algo.clip_ratio_high=0.28"`` -> ``("algo.clip_ratio_high", 0.28)`` (value via yaml.safe_load)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        _fail(f"override {text!r} must look like section.field=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ValueError(f"override {text!r}: cannot parse the value as YAML: {err}") from None
    return key, value


def apply_overrides(tree: dict, overrides) -> dict:
    """Apply dotted overrides (strings ``k=v`` or a mapping ``{k: v}``) to a nested dict in place."""
    items = overrides.items() if isinstance(overrides, dict) else [parse_override(o) for o in overrides]
    for key, value in items:
        _set_dotted(tree, key, value, f" (override {key}={value!r})")
    return tree


def _read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path}")
    with open(path, encoding="utf-8") as fh:
        try:
            data = yaml.safe_load(fh)
        except yaml.YAMLError as err:
            raise ValueError(f"config file {path} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        _fail(f"config file {path} must contain a mapping of sections, got {type(data).__name__}")
    return data


def load_config(path: Optional[str] = None, overrides=(), preset: Optional[str] = None) -> HapoConfig:
    """Defaults <- preset <- YAML file <- dotted overrides; returns a validated HapoConfig.

    ``preset`` replaces a ``preset:`` key at the top of the YAML file. Unknown keys raise
    ValueError listing the valid keys of their section.
    """
    if isinstance(overrides, str):
        overrides = [overrides]
    data = _read_yaml(path) if path else {}
    file_preset = data.pop("preset", None)
    preset = preset or file_preset
    tree: dict = {}
    if preset:
        apply_overrides(tree, preset_overrides(preset))
    for key, value in _flatten(data):
        _set_dotted(tree, key, value, f" (in {path})")
    apply_overrides(tree, list(overrides))
    return HapoConfig.from_dict(tree)


def save_config(cfg: HapoConfig, path: str) -> str:
    """Write the resolved config as YAML (loadable with ``load_config(path)``); returns path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("# hapo_megatron resolved config\n")
        fh.write(format_config(cfg))
    return path


def format_config(cfg: HapoConfig) -> str:
    """Pretty YAML text of the config, one block per section."""
    blocks = []
    for name, section in cfg.to_dict().items():
        blocks.append(yaml.safe_dump({name: section}, sort_keys=False, default_flow_style=False))
    return "\n".join(blocks)
