"""Config sections of the RL side: algorithm, reward, data, rollout (+ SGLang servers), model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from hapo_megatron.config.base import (
    ADV_ESTIMATORS, DTYPES, FILTER_GROUPS_METRICS, KV_CACHE_DTYPES, PARTIAL_MODES, PAUSE_MODES, ROLLOUT_ENGINES,
    ROLLOUT_QUANTIZATIONS, SCORE_FORMATS, WEIGHT_SYNC_MODES,
    _check_choice, _check_min, _check_open_unit, _fail, _Section, inline_field,
)
from hapo_megatron.algo.loss_config import PolicyLossConfig

__all__ = ["AlgoConfig", "RewardConfig", "DataConfig", "SGLangConfig", "RolloutConfig", "LoraConfig", "ModelConfig"]


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
    loss: PolicyLossConfig = inline_field(PolicyLossConfig)
    """The policy loss's knobs (``algo.loss``; written ``algo.<knob>``): their defaults, docs and
    checks are in ``algo/loss_config.py``."""
    filter_groups: bool = False
    """DAPO dynamic sampling: drop groups whose responses all got the same metric value."""
    filter_groups_metric: str = "acc"
    """Metric that dynamic sampling compares within a group: "acc" or "score"."""
    max_num_gen_batches: int = 16
    """Dynamic sampling stops after this many generation batches even if the batch is not full."""
    edge_gec: bool = False
    """EDGE-GRPO's guided error correction (docs/algorithm.md, "EDGE-GRPO"): every wrong response of
    a generation round is, at random, continued by the policy after a reflection cue, or given the
    reference answer after that cue, or replaced by the row's reference solution; then rescored."""
    edge_gec_reflect_prob: float = 0.5
    """GEC: probability, in [0, 1], that a wrong response gets the cue and the policy continues it
    (else it is guided: answer hint or reference solution). EDGE-GRPO's code: 1/2."""
    edge_gec_solution_prob: float = 0.5
    """GEC: probability, in [0, 1], that a guided response is replaced by the reference solution
    (else the answer hint is appended). EDGE-GRPO's code: 1/2."""
    edge_gec_max_new_tokens: int = 256
    """GEC: the policy's token budget after the cue (EDGE-GRPO's code: 256), never past
    rollout.max_response_length."""
    edge_gec_cue: str = " Wait! Something is wrong here."
    """GEC: the reflection cue appended to a wrong response before the policy continues it."""
    edge_gec_hint: str = "\nWait! Something is wrong here. After verification, the correct answer is \\boxed{{answer}}."
    """GEC: the text appended to a wrong response in the answer branch; ``{answer}`` is replaced by
    the row's ground truth (the reward must parse the result: e.g. ``Answer: {answer}``)."""
    edge_gec_solution_key: str = "solution"
    """GEC: the key of the reference solution in a row's extra_info (a row without one gets the
    answer hint instead, counted in gec/solution_missing)."""

    def _validate(self) -> None:
        p = self._path
        _check_choice(f"{p}.adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        _check_min(f"{p}.tlga_fallback_threshold", self.tlga_fallback_threshold, 0.0, strict=True)
        if not 0 <= self.temperature_tau < 1:
            _fail(f"{p}.temperature_tau must be in [0, 1), got {self.temperature_tau}")
        _check_choice(f"{p}.filter_groups_metric", self.filter_groups_metric, FILTER_GROUPS_METRICS)
        _check_min(f"{p}.max_num_gen_batches", self.max_num_gen_batches, 1)
        self._check_gec()

    def _check_gec(self) -> None:
        p = self._path
        for name in ("edge_gec_reflect_prob", "edge_gec_solution_prob"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                _fail(f"{p}.{name} must be in [0, 1], got {value}")
        _check_min(f"{p}.edge_gec_max_new_tokens", self.edge_gec_max_new_tokens, 1)
        if not self.edge_gec_cue:
            _fail(f"{p}.edge_gec_cue must be a non-empty string")
        if "{answer}" not in self.edge_gec_hint:
            _fail(f"{p}.edge_gec_hint must contain {{answer}} (where the ground truth goes), "
                  f"got {self.edge_gec_hint!r}")
        if not self.edge_gec_solution_key:
            _fail(f"{p}.edge_gec_solution_key must be a non-empty string")


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
    num_workers: int = -1
    """Reward worker processes, started once, scoring responses while generation runs: -1 = half
    the usable CPUs (1 to 8); 0 = score in the trainer process after generation (no timeout, no
    crash isolation)."""
    timeout_s: float = 30.0
    """Per-response time limit of the reward in a worker; over it the response scores the format's
    minimum and counts in reward/timeouts."""
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
        _check_min("reward.num_workers", self.num_workers, -1)
        _check_min("reward.timeout_s", self.timeout_s, 0.0, strict=True)
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
    """Longest prompt in tokens; a longer prompt is an error when the dataset is loaded (unless
    filter_overlong_prompts)."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than max_prompt_length (training and validation files) instead of
    refusing the dataset; the count is logged at start and in the data/*_overlong_filtered metrics."""
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
    """Servers to launch in total, spread evenly over the nodes (each node starts its share on its
    own GPUs); 0: fill every node (its GPUs / server_tp_size). Ignored when server_urls is set."""
    server_tp_size: int = 1
    """Tensor-parallel size of each launched server (its GPUs, all on one node)."""
    mem_fraction_static: float = 0.7
    """SGLang's static GPU memory fraction (weights + KV cache), in (0, 1]."""
    weight_sync: str = "auto"
    """How weights reach the servers: auto, tensor (CUDA IPC, colocated), distributed (a broadcast
    group that trainer rank 0 hosts: NCCL with GPU servers, gloo with CPU ones), disk."""
    bucket_size_mb: int = 512
    """Size of one weight-update bucket (MiB)."""
    request_timeout_s: float = 600.0
    """Timeout of one HTTP request to a server (seconds)."""
    max_retries: int = 3
    """Retries of a failed generate request before the step fails."""
    colocate: bool = True
    """Servers share the training GPUs (memory released/resumed around generation)."""
    extra_server_args: list[str] = field(default_factory=list)
    """Extra command-line arguments for launched servers."""
    port_base: int = 30000
    """First port of launched servers (server i of the whole job listens on port_base + i)."""
    max_restarts: int = 3
    """Restarts of launched servers that stop answering (process gone, connection refused, no answer
    within request_timeout_s), per run; their requests go to the other servers meanwhile and a
    restarted server is used again after the next weight sync. One more failure stops the run,
    as does having no server left (docs/multinode.md, "Fault tolerance of the rollout servers")."""
    lora_sync: str = "merged"
    """With LoRA (model.lora.rank > 0), what each weight sync sends: merged (W + alpha/r B A of every
    adapted layer, through weight_sync like full weights; any server) or adapter (only the
    adapters' A and B, loaded with /load_lora_adapter_from_tensors into servers started with
    --enable-lora; CUDA servers only, synchronous rollouts only; docs/lora.md)."""
    pause_mode: str = "retract"
    """How generation pauses for a weight update under rollout.max_staleness >= 1 (SGLang's
    /pause_generation): retract (running requests go back to the queue, their KV cache is recomputed
    after), in_place (they stay, keeping their KV cache from the old weights; SGLang cannot flush its
    cache while they run, so the update keeps it, and every request sent from the update on uses a
    radix-cache namespace of its own, SGLang's cache_salt: no new request reuses prompt-prefix KV
    computed under older weights), abort (they end; each row resumes from its own tokens under the
    new weights, AReaL's interruptible generation)."""

    def _validate(self) -> None:
        p = self._path
        _check_choice(f"{p}.pause_mode", self.pause_mode, PAUSE_MODES)
        _check_choice(f"{p}.lora_sync", self.lora_sync, LORA_SYNC_MODES)
        for name in ("server_tp_size", "bucket_size_mb"):
            _check_min(f"{p}.{name}", getattr(self, name), 1)
        _check_min(f"{p}.num_servers", self.num_servers, 0)
        _check_open_unit(f"{p}.mem_fraction_static", self.mem_fraction_static, right_closed=True)
        _check_choice(f"{p}.weight_sync", self.weight_sync, WEIGHT_SYNC_MODES)
        _check_min(f"{p}.request_timeout_s", self.request_timeout_s, 0.0, strict=True)
        _check_min(f"{p}.max_retries", self.max_retries, 0)
        _check_min(f"{p}.max_restarts", self.max_restarts, 0)
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
    dtype: Optional[str] = None
    """Dtype of the rollout engine's weights and compute: bf16, fp16 or fp32 (null = model.dtype on
    a GPU, fp32 on CPU). The weight sync casts the trainer's weights to it. A precision apart from
    the trainer's is what makes engine and actor disagree (rollout/logprob_abs_diff, and for MoE
    models rollout/routing_mismatch); the CPU MoE example uses bf16 to show routing replay."""
    quantization: str = "none"
    """Weights of the SGLang servers: none (rollout.dtype) or fp8 (blockwise 128x128 E4M3 attention, MLP
    and expert weights, requantised at every weight sync; embeddings, output layer, norms and MoE routers
    stay in rollout.dtype). Needs CUDA servers, rollout.dtype bf16/fp16 and a Qwen2/Qwen3/Qwen3-MoE model
    (SGLang 0.5.23 drops Llama's block scales; docs/fp8.md)."""
    kv_cache_dtype: str = "auto"
    """The SGLang servers' KV-cache dtype (--kv-cache-dtype): auto (the servers' dtype), fp8_e4m3,
    fp8_e5m2, bf16 or bfloat16 (docs/fp8.md)."""
    max_staleness: int = 0
    """Asynchronous rollouts (docs/architecture.md): 0 = generate, then train, each step in turn; k >= 1
    = the servers keep generating while the trainer trains, and a sample may come from weights up to k
    versions older than the ones it is trained from. Needs rollout.engine=sglang with
    rollout.sglang.colocate=false."""
    async_producer: str = "process"
    """Where the asynchronous rollouts' producer runs (rollout.max_staleness >= 1; docs/architecture.md,
    "Asynchronous rollouts"): process (a rollout manager process of its own, spawned by rank 0: its HTTP
    traffic, parsing, scoring and staleness buffer leave the trainer's interpreter; batches come back as
    arrays) or thread (threads inside trainer rank 0)."""
    sync_producer: str = "inline"
    """Where the synchronous loop's rank-0 rollout work runs (rollout.max_staleness=0, rollout.engine=sglang):
    inline (in trainer rank 0) or process (the rollout manager process of rollout.async_producer: the HTTP
    traffic, response parsing, scoring and dynamic sampling leave the trainer's process; the same batches,
    bit for bit; docs/architecture.md, "The rollout manager"). With rollout.over_sampling > 1 the pool of
    partial rollouts goes to the manager with each step and comes back (the trainer checkpoints it)."""
    async_manager_timeout_s: float = 300.0
    """How long trainer rank 0 waits for a sign of life from the rollout manager process (it sends one
    every second while the trainer waits for a batch; rollout.async_producer or rollout.sync_producer:
    process) before it ends the run as hung, saving the last finished step."""
    over_sampling: float = 1.0
    """Over-sampling with partial rollouts (docs/algorithm.md, "Over-sampling and partial rollouts"):
    each generation round starts this factor times the prompts it needs; once enough whole groups are
    in (after dynamic sampling) the rest are aborted and kept, and the next step resumes them first
    under the new weights. With rollout.max_staleness >= 1: a batch takes the groups that finish first,
    passing over up to (factor - 1) x data.train_batch_size groups still running; one passed over
    trains later, its tokens past the bound handled by rollout.partial_mode (docs/architecture.md,
    "Over-sampling under asynchronous rollouts"). 1.0 = off. Needs rollout.engine=sglang."""
    partial_mode: str = "correct"
    """How a resumed response's tokens from older weights train: correct (the off-policy correction,
    algo.rollout_is; auto picks token_tis) or mask_prefix (those tokens are left out of the loss)."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """SGLang server options."""

    def _validate(self) -> None:
        _check_choice("rollout.engine", self.engine, ROLLOUT_ENGINES)
        _check_choice("rollout.quantization", self.quantization, ROLLOUT_QUANTIZATIONS)
        _check_choice("rollout.kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        for name, plain in (("quantization", "none"), ("kv_cache_dtype", "auto")):
            if getattr(self, name) != plain and self.engine != "sglang":
                _fail(f"rollout.{name}={getattr(self, name)!r} needs rollout.engine='sglang' (the hf engine "
                      "keeps rollout.dtype weights and cache)")
        for name in ("n", "max_response_length", "val_n", "hf_max_batch_size"):
            _check_min(f"rollout.{name}", getattr(self, name), 1)
        if self.dtype is not None:
            _check_choice("rollout.dtype", self.dtype, DTYPES)
        _check_min("rollout.temperature", self.temperature, 0.0, strict=True)
        _check_min("rollout.val_temperature", self.val_temperature, 0.0)
        _check_open_unit("rollout.top_p", self.top_p, right_closed=True)
        _check_open_unit("rollout.val_top_p", self.val_top_p, right_closed=True)
        if self.top_k != -1 and self.top_k < 1:
            _fail(f"rollout.top_k must be -1 (off) or >= 1, got {self.top_k}")
        _check_min("rollout.generate_batch_size", self.generate_batch_size, 1)
        _check_min("rollout.max_staleness", self.max_staleness, 0)
        if self.async_producer not in ("process", "thread"):
            _fail(f"rollout.async_producer must be 'process' or 'thread', got {self.async_producer!r}")
        if self.sync_producer not in ("inline", "process"):
            _fail(f"rollout.sync_producer must be 'inline' or 'process', got {self.sync_producer!r}")
        if self.sync_producer == "process" and not self.max_staleness and self.engine != "sglang":
            _fail(f"rollout.sync_producer=process runs the rollout manager over SGLang servers: set "
                  f"rollout.engine=sglang (is {self.engine!r}) or rollout.sync_producer=inline")
        if not self.async_manager_timeout_s > 0:
            _fail(f"rollout.async_manager_timeout_s must be > 0, got {self.async_manager_timeout_s}")
        if self.max_staleness and (self.engine != "sglang" or self.sglang.colocate):
            _fail(f"rollout.max_staleness={self.max_staleness} needs separate rollout servers: set "
                  "rollout.engine=sglang and rollout.sglang.colocate=false (colocated servers share the "
                  "trainer's GPUs, so generation cannot overlap training), or rollout.max_staleness=0")
        _check_min("rollout.over_sampling", self.over_sampling, 1.0)
        _check_choice("rollout.partial_mode", self.partial_mode, PARTIAL_MODES)
        if self.over_sampling > 1.0 and self.engine != "sglang":
            _fail(f"rollout.over_sampling={self.over_sampling} aborts and resumes SGLang requests: set "
                  f"rollout.engine=sglang (is {self.engine!r}), or rollout.over_sampling=1.0")

# LoRA: the HF projections an adapter can target, by the Megatron layer that holds them
LORA_MODULE_PARTS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                     "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
LORA_HF_TARGETS = tuple(p for parts in LORA_MODULE_PARTS.values() for p in parts)
LORA_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
LORA_INITS = ("kaiming_uniform", "gaussian")
LORA_SYNC_MODES = ("merged", "adapter")


def lora_hf_targets(names) -> tuple[str, ...]:
    """The HF projections named by ``model.lora.target_modules`` (HF names, Megatron layer names
    or all-linear), in HF order; ValueError naming the field for an unknown one."""
    wanted = set()
    for name in names:
        if name == "all-linear":
            wanted.update(LORA_HF_TARGETS)
        elif name in LORA_MODULE_PARTS:
            wanted.update(LORA_MODULE_PARTS[name])
        elif name in LORA_HF_TARGETS:
            wanted.add(name)
        else:
            _fail(f"model.lora.target_modules: unknown module {name!r}; choose from {', '.join(LORA_HF_TARGETS)}, "
                  f"{', '.join(LORA_MODULE_PARTS)} or all-linear")
    return tuple(p for p in LORA_HF_TARGETS if p in wanted)


@dataclass
class LoraConfig(_Section):
    """LoRA: train low-rank adapters on the frozen policy (docs/lora.md)."""

    _path: ClassVar[str] = "model.lora"

    rank: int = 0
    """Rank r of the adapters; 0 = off (full fine-tuning). At most the smaller side of every
    targeted layer (checked against the model at start)."""
    alpha: float = 32.0
    """The update is (alpha / rank) * B A (peft's scaling); > 0."""
    dropout: float = 0.0
    """Dropout on the adapters' input in the update passes (never in the log-prob passes), in [0, 1)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_HF_TARGETS))
    """Layers with adapters: HF projection names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj), Megatron layer names (linear_qkv = q, k, v; linear_proj = o; linear_fc1 = gate, up;
    linear_fc2 = down) or all-linear; default every linear layer of attention and MLP. MoE expert
    layers cannot be targets (a MoE model takes attention targets only)."""
    init: str = "kaiming_uniform"
    """Initialisation of A (B starts at zero, so training starts from the base model):
    kaiming_uniform (peft's default, nn.Linear's) or gaussian (N(0, 1/rank))."""

    def _validate(self) -> None:
        p = self._path
        _check_min(f"{p}.rank", self.rank, 0)
        _check_min(f"{p}.alpha", self.alpha, 0.0, strict=True)
        if not 0 <= self.dropout < 1:
            _fail(f"{p}.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            _fail(f"{p}.target_modules must name at least one layer")
        lora_hf_targets(self.target_modules)
        _check_choice(f"{p}.init", self.init, LORA_INITS)


@dataclass
class ModelConfig(_Section):
    """The policy model."""

    _path: ClassVar[str] = "model"

    hf_model_path: Optional[str] = None
    """HF checkpoint (directory or hub name) for the architecture, tokenizer and initial weights. A
    hub name (Qwen/Qwen2.5-Math-7B) is resolved at start to its local snapshot in the HF cache
    (downloaded there if missing; HF_HOME / HF_HUB_OFFLINE apply), which the actor, the tokenizer,
    the SGLang servers and HF exports then all read."""
    megatron_load_path: Optional[str] = None
    """Start from this Megatron checkpoint instead of converting the HF weights."""
    random_init: bool = False
    """Train from a random initialisation (seeded) instead of the weights of model.hf_model_path,
    which then supplies only the architecture and tokenizer. Without it, a model.hf_model_path
    holding no weights and no model.megatron_load_path refuse to start."""
    dtype: str = "bf16"
    """Training parameter dtype: bf16, fp16 or fp32 (CPU runs use fp32)."""
    use_te: Optional[bool] = None
    """Use Transformer Engine layers (null = when installed and CUDA is available)."""
    recompute_activations: bool = False
    """Full activation recomputation to save memory."""
    max_position_embeddings: Optional[int] = None
    """Override of the HF config's max_position_embeddings (null = the model's own). The trainer
    refuses to start when data.max_prompt_length + rollout.max_response_length exceeds the
    model's context; raising it here declares that positions past the pretrained context are
    wanted with the model's unchanged RoPE. Applied identically to the Megatron model, the HF
    rollout engine, launched SGLang servers (--json-model-override-args) and HF exports."""
    offload_during_rollout: Optional[bool] = None
    """Colocated SGLang on CUDA: move the optimizer state, gradient buffers and parameters to
    host memory while the servers generate, and back after (null = on exactly then)."""
    fused_output_layer: bool = True
    """Log-probs and entropies straight from the final hidden states (the output layer fused into
    them, computed slice by slice of the vocabulary): the [T, V/tp] logits and their gradient are
    never materialised."""
    moe_aux_loss_coef: Optional[float] = None
    """MoE models: coefficient of the router load-balancing loss added to the objective (null =
    the HF config's router_aux_loss_coef, 0 = off). Megatron adds it per routed token of each
    micro-batch, divided like the policy loss by the step's global token count; logged as
    actor/moe_aux_loss (before the coefficient). Ignored for dense models."""
    routing_replay: bool = False
    """MoE models: the rollout engine returns the experts it chose for every token, and the
    old-log-prob pass and the updates route each token to those experts (docs/moe.md, "Routing
    replay"); SGLang servers the trainer starts get --enable-return-routed-experts. Needs a MoE
    model."""
    measure_routing_mismatch: bool = False
    """MoE models: also without replay, ask the engine for its routes in a share of the steps
    (model.routing_mismatch_fraction) and log rollout/routing_mismatch there, the share of (token,
    MoE layer) pairs whose top-k expert set the actor chooses otherwise. Off: no routes travel
    unless model.routing_replay (routes are large at scale: docs/moe.md, "Routes volume")."""
    routing_mismatch_fraction: float = 1.0
    """With measure_routing_mismatch and without replay: the share of training steps whose rollouts
    fetch routes, spread evenly (0.1: steps 10, 20, ...; 1: every step)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (rank 0: off)."""

    def _validate(self) -> None:
        _check_choice("model.dtype", self.dtype, DTYPES)
        if self.random_init and self.megatron_load_path:
            _fail("model.random_init=true and model.megatron_load_path both choose the initial weights: "
                  "set one of them")
        _check_min("model.max_position_embeddings", self.max_position_embeddings, 1)
        _check_open_unit("model.routing_mismatch_fraction", self.routing_mismatch_fraction, right_closed=True)
        if self.moe_aux_loss_coef is not None and not self.moe_aux_loss_coef >= 0:
            _fail(f"model.moe_aux_loss_coef must be >= 0 or null, got {self.moe_aux_loss_coef!r}")
        if self.lora.rank and self.megatron_load_path:
            # the base must be an HF directory: the servers load it, and adapter-only checkpoints and
            # the PEFT export refer to it by path and hash (docs/lora.md)
            _fail("model.lora.rank > 0 adapts model.hf_model_path's weights; model.megatron_load_path cannot be the "
                  "base: convert it first (hapo convert megatron-to-hf --megatron-path <ckpt> --hf-model-path <dir>) "
                  "and pass <dir> as model.hf_model_path")
        if self.lora.rank and self.random_init:
            _fail("model.lora.rank > 0 adapts the weights of model.hf_model_path, which its checkpoints hold only "
                  "by reference (adapter-only); model.random_init=true has no such base (set one of them)")
