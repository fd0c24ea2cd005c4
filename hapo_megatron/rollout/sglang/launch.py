"""Starting and stopping SGLang server processes (command lines are pure functions)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

import hapo_megatron
from hapo_megatron.rollout.sglang import server_guard
from hapo_megatron.rollout.sglang.api_key import API_KEY_ENV, redact
from hapo_megatron.dtypes import TORCH_DTYPES, long_name
from hapo_megatron.rollout.sglang.client import ServerHandle

def sglang_dtype(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` / ``"bf16"`` -> ``"bfloat16"`` (SGLang's ``--dtype`` values)."""
    if dtype == "auto" or (isinstance(dtype, str) and dtype in {long_name(d) for d in TORCH_DTYPES.values()}):
        return dtype
    return long_name(dtype)


#: KV-cache tokens of a CPU server (without the flag SGLang sizes the pool from the machine's RAM)
CPU_MAX_TOTAL_TOKENS = 8192
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(hapo_megatron.__file__)))  # checkout/site-packages


#: the key flags of a keyed server: one key for SGLang's plain and admin endpoints
SERVER_KEY_FLAGS = ("--api-key", "--admin-api-key")
_KEYED_MAIN = """import os, runpy, sys
key = os.environ.pop({env!r}, "")
if not key:
    sys.exit("{env} is not set: no API key for {module}")
sys.argv = [{module!r}] + sys.argv[1:] + [f"{{flag}}={{key}}" for flag in {flags!r}]
runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
"""


def module_argv(module: str, key_flags: Sequence[str] = ()) -> list[str]:
    """``["-m", module]``, or with ``key_flags`` a ``-c`` program that runs ``module`` the same way
    with ``FLAG=$HAPO_ROLLOUT_API_KEY`` appended to its own argv: the key never shows on the
    command line (``ps`` lists those to every user of the node). It refuses to start without it.
    ``FLAG=KEY`` in one word: a key starting with ``-`` (1 in 64 of `api_key.new_api_key`'s) would
    otherwise be read by argparse as an option ("--api-key: expected one argument")."""
    if not key_flags:
        return ["-m", module]
    return ["-c", _KEYED_MAIN.format(env=API_KEY_ENV, module=module, flags=tuple(key_flags))]


def resolve_device(device: str = "auto") -> str:
    """``"auto"`` -> ``"cuda"`` when a CUDA device is visible, else ``"cpu"``."""
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be auto, cuda or cpu, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def server_command(model_path: str, *, port: int, host: str = "127.0.0.1", tp_size: int = 1,
                   base_gpu_id: int = 0, mem_fraction_static: float, dtype: str = "bfloat16",
                   enable_memory_saver: bool = False, skip_tokenizer_init: bool = True,
                   extra_args: Sequence[str] = (), python: str = sys.executable, device: str = "cuda",
                   max_total_tokens: int = CPU_MAX_TOTAL_TOKENS, api_key: bool = True, quantization: str,
                   kv_cache_dtype: str) -> list[str]:
    """The ``python -m sglang.launch_server`` command line of one rollout server.

    Always passes ``--enable-custom-logit-processor`` (the adaptive-temperature processor), which
    lets any client that reaches the port run code in the server: ``host`` (the bind address)
    defaults to the loopback address; bind a node's address only when other nodes must reach it.
    ``enable_memory_saver`` (colocated GPU runs) enables ``/release_memory_occupation``.
    ``skip_tokenizer_init``: requests and answers are token ids only.
    ``device="cpu"`` (see :func:`resolve_device`): SGLang's CPU engine flags (``--device cpu
    --attention-backend torch_native --max-total-tokens``, float32, ``--sleep-on-idle``; no memory
    saver, which needs CUDA); run it with :func:`server_env` ``(cpu=True)``.
    ``api_key`` (default): the server requires the key :func:`start_process` hands it
    (``--api-key`` and ``--admin-api-key``, see :func:`module_argv`).
    ``quantization="fp8"``: ``--quantization fp8`` (``model_path`` must then be a block-FP8
    checkpoint, ``fp8_weights.write_fp8_checkpoint``); ``kv_cache_dtype`` other than ``"auto"``:
    ``--kv-cache-dtype`` (docs/fp8.md).
    """
    device = resolve_device(device)
    cmd = [python, *module_argv("sglang.launch_server", SERVER_KEY_FLAGS if api_key else ()),
           "--model-path", str(model_path),
           "--host", host, "--port", str(int(port)), "--tp-size", str(int(tp_size))]
    if device == "cpu":
        # --sleep-on-idle: an idle scheduler otherwise polls its sockets in a busy loop, taking
        # ~0.6 of a core from the trainer that shares the machine (docs/troubleshooting.md)
        cmd += ["--device", "cpu", "--attention-backend", "torch_native",
                "--max-total-tokens", str(int(max_total_tokens)), "--dtype", "float32", "--sleep-on-idle"]
    else:
        cmd += ["--base-gpu-id", str(int(base_gpu_id)), "--mem-fraction-static", str(float(mem_fraction_static)),
                "--dtype", dtype]
        if enable_memory_saver:
            cmd.append("--enable-memory-saver")
    if quantization != "none":
        cmd += ["--quantization", quantization]
    if kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", kv_cache_dtype]
    cmd.append("--enable-custom-logit-processor")
    if skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    return cmd + [str(a) for a in extra_args]


LORA_ADAPTERS_PER_BATCH = 2  # the current adapter and, while it unloads, the previous one


def lora_server_args(rank: int, targets: Sequence[str]) -> list[str]:
    """The flags of a server that serves the policy's LoRA adapters (``rollout.sglang.lora_sync:
    adapter``): LoRA on, the adapters' rank and HF target projections (SGLang sizes its adapter
    memory pool from them at start: ``lora/mem_pool.py``)."""
    return ["--enable-lora", "--max-lora-rank", str(int(rank)), "--lora-target-modules", *targets,
            "--max-loras-per-batch", str(LORA_ADAPTERS_PER_BATCH)]


def cpu_stubs_dir() -> str:
    """Directory of the ``sgl_kernel`` / ``torchvision`` stand-ins and the host-cache fix a CPU
    server needs (`hapo_megatron.compat.sglang_cpu`, shipped with the package)."""
    from hapo_megatron.compat.sglang_cpu import DIRECTORY

    return DIRECTORY


def server_env(*, cpu: bool, base: Optional[dict] = None) -> dict:
    """Environment of a server process: ``base`` (default: ours) with ``hapo_megatron`` importable
    (the custom logit processor is pickled by reference) and, for a CPU server,
    ``SGLANG_USE_CPU_ENGINE=1`` (without it ``--device cpu`` takes CUDA paths) plus the
    import-only stand-ins on ``PYTHONPATH`` (only in the server's environment, never ours), and
    no crash diagnostics (``SGLANG_PYSPY_DUMP_BEFORE_CRASH``, ``SGLANG_CUDA_COREDUMP_BEFORE_CRASH``):
    SGLang sleeps 5 s "to let GPU activity settle" before them whenever its scheduler dies, so every
    stop of a CPU server (:func:`stop_process` signals the whole group) would take 5 s more."""
    env = dict(os.environ if base is None else base)
    for name in _LAUNCHER_VARS:  # torchrun's rendezvous variables would make the server's own
        env.pop(name, None)      # torch.distributed init wait for the trainer's ranks forever
    for name in [k for k in env if k.startswith("TORCHELASTIC_")]:
        env.pop(name)
    paths = [_PACKAGE_PARENT]
    if cpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] = env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] = "0"
        paths.insert(0, cpu_stubs_dir())
    old = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in old if p not in paths])
    return env


def launch_server(model_path: str, *, port: int, host: str, log_path: str, api_key: Optional[str],
                  tp_size: int = 1, base_gpu_id: int = 0, mem_fraction_static: float,
                  dtype: torch.dtype | str = "bfloat16", colocate: bool,
                  extra_args: Sequence[str] = (), device: str = "cuda",
                  url_host: Optional[str] = None, quantization: str,
                  kv_cache_dtype: str) -> ServerHandle:
    """Start one rollout server (:func:`server_command` run by :func:`start_process` in
    :func:`server_env`), bound to ``host`` and reached at ``url_host`` (default ``host``). With
    ``api_key`` the server requires that key; without one it runs keyless. A port that already
    accepts connections is refused in one line: the server could not bind it, and the trainer would
    wait on (or talk to) whatever holds it."""
    if accepts_connections(host, int(port)):
        raise RuntimeError(f"port {int(port)} on {host} is in use by another process (another run's server?): "
                           f"set rollout.sglang.port_base to a free range")
    cmd = server_command(model_path, port=port, host=host, tp_size=tp_size, base_gpu_id=base_gpu_id,
                         mem_fraction_static=mem_fraction_static, dtype=sglang_dtype(dtype),
                         enable_memory_saver=colocate, extra_args=extra_args, device=device,
                         api_key=bool(api_key), quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    return start_process(cmd, f"http://{url_host or host}:{int(port)}", tp_size=tp_size, log_path=log_path,
                         env=server_env(cpu=resolve_device(device) == "cpu"), api_key=api_key)


def node_ip(toward: Optional[str] = None) -> str:
    """This node's address as seen by other nodes: the one of the interface that routes to
    ``toward`` (a host, e.g. MASTER_ADDR; default: the default route). No packet is sent."""
    for target in ([toward] if toward else []) + ["10.255.255.255"]:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.connect((target, 1))
            return s.getsockname()[0]
        except OSError:
            continue
        finally:
            s.close()
    return "127.0.0.1"


def accepts_connections(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def ephemeral_port_range() -> tuple[int, int]:
    """The OS's range of ports handed to `bind(port 0)` and outgoing connections (Linux's
    ip_local_port_range; its default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


#: consecutive ports `free_port` checks: a run's servers listen on port_base + i
FREE_RUN = 8


def free_port() -> int:
    """The first of ``FREE_RUN`` consecutive TCP ports that were free a moment ago, below the OS's
    ephemeral range. WHY below it: a port picked by `bind(port 0)` comes from that range, where
    the trainer's own gloo listeners and connections take theirs in the seconds before a server
    binds it (seen: a recipe test's server lost its port to a trainer rank's gloo listener, and the
    run waited on that listener)."""
    low = max(1024 + FREE_RUN, min(ephemeral_port_range()[0], 65536) - FREE_RUN)
    first = 10000 if low > 10000 + FREE_RUN else 1024  # clear of the well-known and registered low ports
    for _ in range(1000):
        base = random.randrange(first, low)
        if all(_bindable(base + i) for i in range(FREE_RUN)):
            return base
    raise RuntimeError(f"no {FREE_RUN} consecutive free ports below {low}")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class LaunchSpec:
    """How :func:`start_process` started a server: :func:`restart_process` repeats it exactly
    (same command line, so the same GPUs, port and flags; same environment and API key)."""

    cmd: tuple[str, ...]
    env: Optional[dict]
    api_key: Optional[str]

    def __repr__(self) -> str:  # the key stays out of logs and tracebacks
        return f"LaunchSpec(cmd={list(self.cmd)!r})"


def start_process(cmd: list[str], url: str, *, log_path: Optional[str], tp_size: int = 1,
                  env: Optional[dict] = None, api_key: Optional[str] = None) -> ServerHandle:
    """Start ``cmd`` in its own session (so :func:`stop_process` can end its whole tree),
    logging to ``log_path``. ``api_key`` reaches the process as ``$HAPO_ROLLOUT_API_KEY`` (see
    :func:`module_argv`); SGLang prints its arguments, key included, so its output then passes
    through a thread of ours that writes it to ``log_path`` with the key replaced."""
    spec = LaunchSpec(cmd=tuple(cmd), env=None if env is None else dict(env), api_key=api_key)
    handle = _popen(cmd, url, log_path=log_path, tp_size=tp_size, env=env, api_key=api_key)
    handle.launch = spec
    return handle


# WHY: SLURM's `--signal=USR1@N` (and preemption) signal every process of the job step, the servers
# included, and SGLang has no handler for SIGUSR1/SIGUSR2, whose default action ends the process: the
# trainer would lose its servers in the middle of the save it was asked for. Started with them
# ignored (ignored dispositions survive exec), the servers outlive the signal and the trainer stops
# them itself. SIGTERM/SIGINT stay: uvicorn handles them, and stop_process uses SIGTERM.
IGNORED_SIGNALS = ("USR1", "USR2")
#: how long a stopping server may take before its guard SIGKILLs its process group (server_guard.py)
STOP_GRACE_S = 10.0


def guarded(cmd: list[str], grace_s: float = STOP_GRACE_S) -> list[str]:
    """``cmd`` run through :mod:`server_guard` (same pid: it ``exec``s ``cmd``): IGNORED_SIGNALS
    ignored, and its whole process group ends with this process, however this process ends
    (docs/multinode.md, "Server lifetime")."""
    return [sys.executable, "-I", "-S", server_guard.__file__, str(os.getpid()), str(float(grace_s)),
            ",".join(IGNORED_SIGNALS), *cmd]


def _popen(cmd: list[str], url: str, *, log_path: Optional[str], tp_size: int, env: Optional[dict],
           api_key: Optional[str]) -> ServerHandle:
    cmd = guarded(cmd)
    env = dict(env if env is not None else os.environ)
    env.pop(API_KEY_ENV, None)  # only the key we mean to hand over
    if api_key:
        env[API_KEY_ENV] = api_key
    if api_key and log_path:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env)
        copier = threading.Thread(target=_copy_redacted, args=(proc.stdout, log_path, api_key), daemon=True,
                                  name=f"log {os.path.basename(log_path)}")
        copier.start()
        return ServerHandle(url=url, process=proc, log_path=log_path, tp_size=tp_size, log_copier=copier)
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    finally:
        if log_path:
            log.close()
    return ServerHandle(url=url, process=proc, log_path=log_path, tp_size=tp_size)


def restart_process(handle: ServerHandle, *, port_free_timeout_s: float = 60.0) -> None:
    """Replace ``handle``'s process by a new one started exactly as the first (``handle.launch``),
    in place: every list holding the handle sees the new process. The old process group is
    killed first (SIGKILL: a stopped or wedged server ignores SIGTERM) and its port awaited.
    Does not wait for the new server to answer."""
    spec = handle.launch
    if spec is None:
        raise ValueError(f"SGLang server {handle.url} was not started by this process: it cannot be restarted here")
    kill_process(handle)
    _wait_port_free(handle.url, port_free_timeout_s)
    new = _popen(list(spec.cmd), handle.url, log_path=handle.log_path, tp_size=handle.tp_size, env=spec.env,
                 api_key=spec.api_key)
    handle.process, handle.log_copier = new.process, new.log_copier


def kill_process(handle: ServerHandle) -> None:
    """SIGKILL the process group we started (a no-op when it has exited) and reap it."""
    proc = handle.process
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    if handle.log_copier is not None:
        handle.log_copier.join(timeout=5.0)
        handle.log_copier = None


def _wait_port_free(url: str, timeout_s: float) -> None:
    """Until nothing accepts connections on ``url``'s port (the killed server's children may
    hold its socket a moment longer), at most ``timeout_s``."""
    from urllib.parse import urlparse

    parsed = urlparse(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not accepts_connections(parsed.hostname, parsed.port):
            return
        time.sleep(0.2)


def _copy_redacted(stream, log_path: str, key: str) -> None:
    """Copy ``stream`` line by line to ``log_path`` with ``key`` replaced, until the process ends."""
    with stream, open(log_path, "ab") as log:
        for line in iter(stream.readline, b""):
            log.write(redact(line, key))
            log.flush()  # the log tail in error messages must be current


def stop_process(handle: ServerHandle, timeout_s: float = 30.0) -> None:
    """SIGTERM the process group we started, SIGKILL it after ``timeout_s``. The server's guard
    (:mod:`server_guard`) SIGKILLs the group itself after ``STOP_GRACE_S``, also when this process
    dies while it waits."""
    proc = handle.process
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout_s)
    except ProcessLookupError:
        pass


__all__ = ["sglang_dtype", "server_command", "resolve_device", "server_env", "cpu_stubs_dir",
           "node_ip", "free_port", "accepts_connections", "ephemeral_port_range", "start_process", "launch_server",
           "stop_process", "LaunchSpec", "restart_process", "kill_process"]
__all__ += ["module_argv", "SERVER_KEY_FLAGS", "lora_server_args"]  # the API key (rollout/sglang/api_key.py)
