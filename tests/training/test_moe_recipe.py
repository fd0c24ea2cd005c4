"""The Qwen3-30B-A3B MoE recipe (examples/qwen3-30b-a3b): its config validates, its layout
(TP2 x PP2 x EP8, ETP1, SP) runs on two 8-GPU nodes and is refused where it cannot, routing replay
is on, the SGLang servers get the expert-parallel flag, and the doctor's memory plan at 16 ranks
fits an 80 GB card. Runs on CPU in seconds: the model shape comes from the committed
hf_config.json (Qwen3-30B-A3B's public architecture numbers; no download)."""

import os

import pytest
import yaml

from hapo_megatron.config import HapoConfig, load_config
from tests.training.tiny_setup import ROOT

RECIPE = os.path.join(ROOT, "examples", "qwen3-30b-a3b")
CONFIG = os.path.join(RECIPE, "config.yaml")
HF_CONFIG = os.path.join(RECIPE, "hf_config.json")
SHAPE = [f"model.hf_model_path={HF_CONFIG}"]  # the architecture without the weights
H100_GIB = 79.6  # an "80 GB" H100 as torch reports it


@pytest.fixture(scope="module")
def cfg() -> HapoConfig:
    return load_config(CONFIG, SHAPE)


@pytest.fixture(scope="module")
def hf_config():
    from hapo_megatron.training.sources import load_hf_config
    return load_hf_config(HF_CONFIG, max_position_embeddings=None)


def test_config_loads_and_validates(cfg):
    assert isinstance(cfg, HapoConfig)
    assert cfg.algo == load_config(None, preset="hapo").algo  # the algorithm is the preset's, untouched
    with open(CONFIG) as f:
        raw = yaml.safe_load(f)
    assert raw["preset"] == "hapo" and raw["model"]["hf_model_path"] == "Qwen/Qwen3-30B-A3B-Base"
    # the file names the layout itself (a dropped field would silently fall back to its default)
    p = raw["parallel"]
    assert (p["tensor_model_parallel_size"], p["pipeline_model_parallel_size"], p["expert_model_parallel_size"],
            p["expert_tensor_parallel_size"], p["sequence_parallel"]) == (2, 2, 8, 1, True)
    assert raw["model"]["recompute_activations"] is True
    # the DAPO baseline loads from the same file
    assert load_config(CONFIG, SHAPE, preset="dapo").parallel == cfg.parallel


def test_shape_file_is_qwen3_30b_a3b(hf_config):
    from hapo_megatron.config.validate import ModelSpec
    from hapo_megatron.training.memory.plan import param_count, shape_from_hf_config
    assert ModelSpec.of(hf_config).is_moe and hf_config.model_type == "qwen3_moe"
    assert (hf_config.num_experts, hf_config.num_experts_per_tok, hf_config.moe_intermediate_size) == (128, 8, 768)
    assert param_count(shape_from_hf_config(hf_config)) == 30_532_122_624  # the published 30.5B


def test_layout_fits_the_model(cfg, hf_config):
    from hapo_megatron.config.validate import ModelSpec, validate_run
    from hapo_megatron.train import check_dist_timeout
    from hapo_megatron.training.context_length import check_sequence_fits
    validate_run(cfg, ModelSpec.of(hf_config), 16)
    check_sequence_fits(hf_config, cfg)
    for world in (8, 16):  # one node (train.sh) and two nodes: a generation round < the job timeout
        check_dist_timeout(cfg, world)


def test_layout_valid_for_two_nodes_and_refused_where_it_cannot_run(cfg):
    p = cfg.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size) == (2, 2, 1)
    assert (p.expert_model_parallel_size, p.expert_tensor_parallel_size, p.sequence_parallel) == (8, 1, True)
    assert p.validate_world(16) == 4  # 2 nodes x 8 GPUs: DP 4
    assert p.validate_world(32) == 8
    with pytest.raises(ValueError, match="expert grid"):  # one node: ETP1 x EP8 x PP2 = 16 does not divide 8
        p.validate_world(8)
    with pytest.raises(ValueError, match="not divisible"):  # not even TP x PP
        p.validate_world(6)
    with pytest.raises(ValueError, match="expert grid"):
        p.validate_world(12)
    # train.sh's one-node override is a valid layout there
    assert load_config(CONFIG, SHAPE + ["parallel.expert_model_parallel_size=4"]).parallel.validate_world(8) == 2


def test_routing_replay_on(cfg, hf_config):
    from hapo_megatron.training.build import engine_returns_routes, routing_mode
    assert cfg.model.routing_replay is True
    assert routing_mode(cfg, hf_config) == "replay" and engine_returns_routes(cfg, hf_config)


def test_sglang_servers_carry_the_ep_size(cfg):
    from hapo_megatron.training.context_length import sglang_context_args
    sg = cfg.rollout.sglang
    assert cfg.rollout.engine == "sglang" and sg.colocate and sg.server_tp_size == 4
    args = list(sg.extra_server_args)
    assert "--ep-size" in args
    ep = int(args[args.index("--ep-size") + 1])
    assert ep == sg.server_tp_size  # SGLang takes EP 1 or EP = its TP
    assert sglang_context_args(cfg, sg.extra_server_args)[:2] == ["--ep-size", "4"]  # no clash with other flags


def test_sglang_knows_the_ep_flag():
    pytest.importorskip("sglang")
    import argparse

    from sglang.srt.server_args import ServerArgs
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns, rest = parser.parse_known_args(["--model-path", "x", "--ep-size", "4"])
    assert not rest and ns.ep_size == 4


def test_two_node_servers_fit_the_nodes(cfg):
    from hapo_megatron.rollout.sglang.placement import plan_servers
    sg = cfg.rollout.sglang
    slots = plan_servers(num_servers=sg.num_servers, server_tp_size=sg.server_tp_size, num_nodes=2, ranks_per_node=8,
                         colocate=sg.colocate, gpus_per_node=8, port_base=sg.port_base)
    assert len(slots) == 4  # two TP4 servers per node


def _memory(config_path: str, world: int, overrides=()):
    from hapo_megatron.doctor.memory_checks import check_memory_plan
    return check_memory_plan(config_path, SHAPE + list(overrides), world_size=world, device_memory_gib=H100_GIB)


def test_memory_plan_at_16_ranks_fits_80gb(cfg, hf_config):
    from hapo_megatron.doctor.report import PASS
    from hapo_megatron.training.memory.plan import GiB, plan_from_config
    res, text = _memory(CONFIG, 16)
    plan = plan_from_config(cfg, hf_config, world_size=16, device_bytes=int(H100_GIB * GiB))
    assert plan.fits, text
    assert res.status == PASS and "fits: yes" in text, text
    assert res.figure.startswith(f"peak {plan.peak / GiB:.1f} of {H100_GIB:.1f} GiB"), res.figure
    # the README quotes what the doctor prints
    with open(os.path.join(RECIPE, "README.md")) as f:
        readme = f.read()
    assert res.figure in readme, f"README.md does not quote the doctor's {res.figure!r}"
    for line in text.splitlines()[1:]:
        assert line.strip() in readme, f"README.md does not quote the plan line {line.strip()!r}"


def test_doctor_refuses_a_world_the_layout_does_not_divide():
    with pytest.raises(ValueError, match="expert grid") as e:
        _memory(CONFIG, 8)
    assert "--world-size" in e.value.fix


def test_dropping_the_expert_parallel_size_is_caught(tmp_path, cfg, hf_config):
    """The mutation the recipe must not suffer: without parallel.expert_model_parallel_size the
    layout still divides 16 ranks (EP 1), but every GPU of a stage then holds all 128 experts of
    its 24 layers, which the plan refuses; the tests above fail on it too (they read the field)."""
    from hapo_megatron.training.memory.plan import GiB, plan_from_config
    with open(CONFIG) as f:
        raw = yaml.safe_load(f)
    del raw["parallel"]["expert_model_parallel_size"]
    mutated = tmp_path / "config.yaml"
    mutated.write_text(yaml.safe_dump(raw))
    m = load_config(str(mutated), SHAPE)
    assert m.parallel.expert_model_parallel_size == 1
    assert m.parallel.validate_world(16) == 4
    assert not plan_from_config(m, hf_config, world_size=16, device_bytes=int(H100_GIB * GiB)).fits
    from hapo_megatron.doctor.report import FAIL
    res, _ = _memory(str(mutated), 16)
    assert res.status == FAIL


def test_memory_plan_reads_the_config_fields(cfg, hf_config):
    """plan_from_config wiring of the memory terms the recipe changes (fails when a field is dropped
    from plan_from_config; tried for each): the fused output layer (off: fp32 logits and their
    gradient, 2 x 4 x 22528 x 151936 / 2 bytes = 12.75 GiB more on the last stage), routing replay or
    mismatch measurement (the step's int16 routes: 512 x 16 x 11264 tokens / 4 DP ranks x 48
    layers x 8 x 2 bytes), the KL reference (one more bf16 copy of this GPU's params), and the
    device size in GiB."""
    import dataclasses

    from hapo_megatron.doctor.memory_checks import check_memory_plan
    from hapo_megatron.training.memory.plan import GiB, plan_from_config

    def plan(**sections):
        c = dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()})
        return plan_from_config(c, hf_config, world_size=16, device_bytes=int(H100_GIB * GiB))

    base = plan()
    assert cfg.model.fused_output_layer and cfg.model.routing_replay and cfg.algo.loss.kl_loss_coef == 0
    assert base.routes == 512 * 16 * (1024 + 10240) // 4 * (48 // 2) * 8 * 1  # PP=2: a stage's layers, uint8 ids
    assert plan(model={"routing_replay": False, "measure_routing_mismatch": False}).routes == 0
    measured = plan(model={"routing_replay": False, "measure_routing_mismatch": True})
    assert measured.routes == base.routes  # mismatch measurement fetches them too
    with_kl = dataclasses.replace(cfg.algo.loss, kl_loss_coef=0.001)
    assert base.reference == 0 and plan(algo={"loss": with_kl}).reference == base.params
    logits = plan(model={"fused_output_layer": False}).activations - base.activations
    # 12.75 GiB of logits less the fused kernel's ~1 GiB (slices of 1024 x 75968, accumulator, gather)
    assert 11.5 * GiB < logits < 12.75 * GiB
    _, text = check_memory_plan(CONFIG, SHAPE, world_size=16, device_memory_gib=H100_GIB)
    assert "(16 ranks, 79.6 GiB device)" in text and f"of {int(H100_GIB * GiB) / GiB:.1f} GiB" in text


def test_tensor_sync_contexts_follow_the_server_layout(cfg):
    """tensor_sync_peer_contexts wiring: the recipe's 8-GPU nodes with two TP4 servers each (colocated,
    weight_sync auto = tensor) put 7 other workers' contexts on the leader's GPU; none with disk sync
    or separate servers; a 4-GPU node 3; one server per node 3. Fails when a config field is not
    read (tried: returning 0, ignoring num_servers); plan_from_config dropping the term fails
    test_memory_plan_at_16_ranks_fits_80gb (the README's overhead line)."""
    import dataclasses

    from hapo_megatron.training.memory.plan import tensor_sync_peer_contexts

    def sg(**kw):
        return dataclasses.replace(cfg, rollout=dataclasses.replace(
            cfg.rollout, sglang=dataclasses.replace(cfg.rollout.sglang, **kw)))
    assert tensor_sync_peer_contexts(cfg, 8) == 7 and tensor_sync_peer_contexts(cfg, 4) == 3
    assert tensor_sync_peer_contexts(sg(weight_sync="disk"), 8) == 0
    assert tensor_sync_peer_contexts(sg(colocate=False), 8) == 0
    assert tensor_sync_peer_contexts(sg(num_servers=1), 8) == 3
