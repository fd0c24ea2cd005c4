"""The import-only stand-ins of hapo_megatron/compat/sglang_cpu: importable (packages,
sub-modules, names, attributes of names), and every name raises NotImplementedError when called.
Run in a subprocess: they must never enter the test process's (or the trainer's) import path.
They ship with the package."""

import os
import subprocess
import sys
import textwrap

from hapo_megatron.rollout.sglang.launch import cpu_stubs_dir, server_env

CHECK = textwrap.dedent("""
    import sgl_kernel, torchvision
    from sgl_kernel import silu_and_mul
    from sgl_kernel.kvcacheio import transfer_kv_per_layer
    from torchvision.transforms import InterpolationMode
    import torchvision.transforms.v2.functional as F
    mode = InterpolationMode.BICUBIC
    assert sgl_kernel.__hapo_stand_in__ and torchvision.__version__.startswith("0.0.0")
    for fn in (silu_and_mul, transfer_kv_per_layer, F.resize, mode):
        try:
            fn(1, 2)
        except NotImplementedError as e:
            assert "stand-in" in str(e), e
        else:
            raise SystemExit(f"{fn!r} did not raise")
    print("ok")
""")


def test_stand_ins_import_and_raise_when_called():
    env = server_env(cpu=True)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == cpu_stubs_dir()
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    # no crash diagnostics: SGLang sleeps 5 s before them on every stop of a server
    assert env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0"
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    assert cpu_stubs_dir() not in sys.path  # never in our own process


def test_stand_ins_ship_with_the_package():
    # setup.cfg finds packages with setuptools' find: an installed hapo_megatron carries the stand-ins
    import setuptools

    import hapo_megatron
    root = os.path.dirname(os.path.dirname(hapo_megatron.__file__))
    found = set(setuptools.find_packages(root, include=["hapo_megatron*"]))
    assert {"hapo_megatron.compat.sglang_cpu", "hapo_megatron.compat.sglang_cpu.sgl_kernel",
            "hapo_megatron.compat.sglang_cpu.torchvision"} <= found
    assert cpu_stubs_dir() == os.path.join(os.path.dirname(hapo_megatron.__file__), "compat", "sglang_cpu")
