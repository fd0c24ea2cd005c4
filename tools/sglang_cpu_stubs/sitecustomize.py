"""Run at start-up by every Python process that has this directory on its PYTHONPATH, i.e. a CPU
SGLang server's processes only (`hapo_megatron.rollout.sglang.launch.server_env`): installs the
CPU host-cache fix (`hapo_cpu_host_cache`) when SGLang's CPU engine is selected."""

import os

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    import hapo_cpu_host_cache

    hapo_cpu_host_cache.install()


def _run_next_sitecustomize():
    """Python imports only the first ``sitecustomize`` on the path; run the next one too (e.g. the
    test suite's network guard, docs/testing.md), so that putting this directory first hides none."""
    import importlib.util
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    dirs = [os.path.abspath(p or os.curdir) for p in sys.path]
    for d in dirs[dirs.index(here) + 1:] if here in dirs else []:
        path = os.path.join(d, "sitecustomize.py")
        if os.path.isfile(path) and d != here:
            spec = importlib.util.spec_from_file_location("_hapo_next_sitecustomize", path)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_run_next_sitecustomize()
