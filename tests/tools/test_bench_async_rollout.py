"""Smoke test of tools/bench/async_rollout.py at its tiny size (`--small`: no calibration, one
measured step per setting): the three settings run in one call and report steps per hour, the
trainer's idle fraction and a staleness within each setting's bound."""

import pytest

from tests.tools._load import load_tool

pytestmark = pytest.mark.slow


def test_small_run_reports_every_setting(tmp_path, capsys):
    """With over-sampling (the third setting: max_staleness 1, over_sampling 2) on heavy-tailed
    lengths."""
    bench = load_tool("bench/async_rollout")
    out = bench.main(["--small", "--out", str(tmp_path), "--over-sampling", "2", "--length-median", "2"])
    res = out["results"]
    assert sorted(res) == ["0", "1", "1 os2"]
    for label, r in res.items():
        assert r["steps"] == 1 and r["steps_per_hour"] > 0 and 0 <= r["idle_frac"] <= 1
    assert res["0"]["staleness_max"] == 0 and res["1"]["staleness_max"] <= 1
    printed = capsys.readouterr().out
    assert "steps/h" in printed and "ratio" in printed and "idle" in printed


def test_summarize_counts_steps_after_the_warm_up():
    bench = load_tool("bench/async_rollout")
    recs = [{"perf/step_time_s": 9.0, "timing/rollout_s": 9.0}] * 2 + [
        {"perf/step_time_s": 2.0, "timing/trainer_wait_s": 0.5, "rollout/staleness_max": 1.0},
        {"perf/step_time_s": 2.0, "timing/trainer_wait_s": 0.5, "rollout/staleness_max": 0.0}]
    s = bench.summarize(recs)
    assert s["steps"] == 2 and s["wall_s"] == 4.0 and s["steps_per_hour"] == 1800.0
    assert s["idle_frac"] == 0.25 and s["staleness_max"] == 1.0


def test_combine_sums_the_rounds_of_one_setting():
    bench = load_tool("bench/async_rollout")
    a = bench.summarize([{"perf/step_time_s": 2.0, "timing/trainer_wait_s": 0.5, "rollout/staleness_max": 1.0}] * 2,
                        warmup=0)
    b = bench.summarize([{"perf/step_time_s": 4.0, "timing/trainer_wait_s": 1.0, "rollout/staleness_max": 0.0}],
                        warmup=0)
    c = bench.combine([a, b])
    assert c["steps"] == 3 and c["wall_s"] == 8.0 and c["steps_per_hour"] == 1350.0
    assert c["idle_frac"] == 0.25 and c["busy_s_per_step"] == 2.0 and c["staleness_max"] == 1.0
    assert c["step_times"] == [2.0, 2.0, 4.0] and c["steps_per_hour_median"] == 1800.0


def test_host_figures_are_means_per_measured_step():
    """The CPU table: each figure summed over the measured steps of every round, per step."""
    bench = load_tool("bench/async_rollout")
    row = {"perf/step_time_s": 2.0, "timing/trainer_wait_s": 0.5, "timing/producer_cpu_s": 0.25,
           "perf/host_process_cpu_s": 1.0, "perf/host_torch_threads": 1.0}
    a = bench.summarize([{"perf/step_time_s": 9.0, "timing/producer_cpu_s": 7.0}, row, row], warmup=1)
    a["server_cpu"] = 0.5
    b = bench.summarize([{**row, "timing/producer_cpu_s": 0.75}], warmup=0)
    c = bench.combine([a, b])
    assert c["producer_cpu_per_step"] == (0.25 + 0.25 + 0.75) / 3
    assert c["process_cpu_per_step"] == 1.0 and c["torch_threads_per_step"] == 1.0
    assert c["server_cpu_per_step"] == 0.5 / 3 and c["main_cpu_per_step"] == 0.0


def test_sglang_mode_runs_the_job_on_servers_its_trainer_launches():
    """``--servers sglang``: no URL and no disk sync (the trainer launches its servers and syncs
    by its default), the model and prompts asked for; the paced mode attaches by URL and syncs by
    disk. Dropping any of these on the way fails here."""
    bench = load_tool("bench/async_rollout")
    launched = bench.LaunchedServers(model="/m/qwen", train_file="/d/train.parquet", num_servers=2)
    kv = dict(o.split("=", 1) for o in bench.job_overrides("/data", "/run", None, max_staleness=1, steps=3,
                                                           launched=launched))
    assert "rollout.sglang.server_urls" not in kv and "rollout.sglang.weight_sync" not in kv
    assert kv["rollout.sglang.num_servers"] == "2" and kv["rollout.sglang.colocate"] == "false"
    assert kv["model.hf_model_path"] == kv["data.tokenizer_path"] == "/m/qwen" and kv["model.dtype"] == "bf16"
    assert kv["data.train_files"] == "[/d/train.parquet]" and kv["rollout.max_staleness"] == "1"
    assert 1024 <= int(kv["rollout.sglang.port_base"]) < 65536
    paced = dict(o.split("=", 1) for o in bench.job_overrides("/data", "/run", ["http://a:1", "http://b:2"],
                                                              max_staleness=0, steps=3))
    assert paced["rollout.sglang.server_urls"] == "[http://a:1,http://b:2]"
    assert paced["rollout.sglang.weight_sync"] == "disk" and paced["model.hf_model_path"] == "/data/model"


def test_model_without_sglang_servers_is_refused_in_one_line(capsys):
    bench = load_tool("bench/async_rollout")
    with pytest.raises(SystemExit) as e:
        bench.main(["--model", "/m/qwen"])
    assert e.value.code == 2 and "--model and --train-file need --servers sglang" in capsys.readouterr().err
