"""Run at start-up by every Python process that has this directory on its PYTHONPATH, i.e. a CPU
SGLang server's processes only (`hapo_megatron.rollout.sglang_launch.server_env`): installs the
CPU host-cache fix (`hapo_cpu_host_cache`) when SGLang's CPU engine is selected."""

import os

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    import hapo_cpu_host_cache

    hapo_cpu_host_cache.install()
