"""Start this node's SGLang rollout servers and keep them running (servers a trainer attaches to by
URL, e.g. on rollout nodes of their own; servers the trainer launches it places on every node
itself, see ``node_servers``).

    python -m hapo_megatron.rollout.sglang.serve --model-path Qwen/Qwen2.5-Math-7B \\
        --num-servers 4 --tp-size 2 --port-base 30000 --mem-fraction-static 0.45 --colocate \\
        --log-dir runs/x/sglang -- --context-length 11264

Server ``i`` uses GPUs ``base_gpu_id + i * tp .. + tp - 1`` and port ``port_base + i``, always with
``--enable-custom-logit-processor`` (``--enable-memory-saver`` with ``--colocate``). The command
prints one URL per line once every server answers ``/health``, then waits; SIGTERM / SIGINT stop
the servers. The trainer attaches with ``rollout.sglang.server_urls=[...]``.

FP8 servers (``--quantization fp8``, docs/fp8.md) start from a block-FP8 copy of the model written
to ``LOG_DIR/fp8_model``; the trainer attaching to them must set ``rollout.quantization=fp8`` too,
so that its weight syncs are quantised the same way.

Every server requires the run's API key (``rollout/sglang/api_key.py``): ``$HAPO_ROLLOUT_API_KEY``, else
the one in ``--api-key-file``, which is created (owner-only) when missing. Point every node's
``--api-key-file`` at ``<run_dir>/rollout_api_key`` on the shared file system: the first node
creates it, the others and the trainer read it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Optional, Sequence

from hapo_megatron.config.base import KV_CACHE_DTYPES, ROLLOUT_QUANTIZATIONS
from hapo_megatron.config.sections import RolloutConfig, SGLangConfig
from hapo_megatron.rollout.sglang import fp8_serving
from hapo_megatron.rollout.sglang import launch
from hapo_megatron.rollout.sglang.api_key import API_KEY_ENV, KEY_FILE_NAME, resolve_api_key
from hapo_megatron.rollout.sglang.client import SGLangHTTP


_SGLANG = SGLangConfig()  # the launch flags' defaults are the config's (rollout.sglang.*)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hapo_megatron.rollout.sglang.serve",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--num-servers", type=int, default=_SGLANG.num_servers)
    p.add_argument("--tp-size", type=int, default=_SGLANG.server_tp_size)
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--port-base", type=int, default=_SGLANG.port_base)
    p.add_argument("--host", default=None,
                   help="bind address (default: this node's address on the interface toward other nodes; "
                        "127.0.0.1 for a trainer on the same node; never 0.0.0.0 unless asked)")
    p.add_argument("--advertise-host", default=None, help="host in the printed URLs (default: the bind address)")
    p.add_argument("--mem-fraction-static", type=float, default=_SGLANG.mem_fraction_static)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="cpu: SGLang's CPU engine (float32, import-only stand-ins); auto: cuda when visible")
    p.add_argument("--colocate", action="store_true", help="enable release/resume of GPU memory")
    p.add_argument("--quantization", default=RolloutConfig().quantization, choices=ROLLOUT_QUANTIZATIONS,
                   help="fp8: block-FP8 weights (the trainer sets rollout.quantization=fp8; docs/fp8.md)")
    p.add_argument("--kv-cache-dtype", default=RolloutConfig().kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="the servers' KV-cache dtype")
    p.add_argument("--log-dir", default="sglang_logs")
    p.add_argument("--url-file", default=None, help="also write the URLs to this file")
    p.add_argument("--api-key-file", default=None,
                   help="the servers' API key, created owner-only if missing (default: LOG_DIR/rollout_api_key; "
                        "$HAPO_ROLLOUT_API_KEY wins); the trainer reads <run_dir>/rollout_api_key")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="start-up time limit")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: extra sglang.launch_server arguments")
    a = p.parse_args(argv)
    if a.extra and a.extra[0] == "--":
        a.extra = a.extra[1:]
    for name in ("num_servers", "tp_size"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return a


def serving_model_path(a: argparse.Namespace, device: str) -> str:
    """The model directory the servers load: ``--model-path``, or its block-FP8 copy in
    ``--log-dir`` for ``--quantization fp8`` (refused on CPU servers and with float32)."""
    fp8_serving.check_launch(a.quantization, device=device, dtype=a.dtype)
    return fp8_serving.serving_model_path(a.model_path, a.quantization, a.log_dir, tp_size=a.tp_size)


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    os.makedirs(a.log_dir, exist_ok=True)
    bind = a.host or launch.node_ip()
    host = a.advertise_host or bind
    key_file = a.api_key_file or os.path.join(a.log_dir, KEY_FILE_NAME)
    key = resolve_api_key(key_file, create=True)
    if not os.environ.get(API_KEY_ENV):
        print(f"API key of these servers: in {key_file}", file=sys.stderr, flush=True)
    http = SGLangHTTP(timeout_s=30, max_retries=_SGLANG.max_retries, api_key=key)
    servers = []
    device = launch.resolve_device(a.device)
    model_path = serving_model_path(a, device)
    for i in range(a.num_servers):
        servers.append(launch.launch_server(
            model_path, port=a.port_base + i, host=bind, url_host=host, tp_size=a.tp_size,
            base_gpu_id=a.base_gpu_id + i * a.tp_size, mem_fraction_static=a.mem_fraction_static, dtype=a.dtype,
            colocate=a.colocate, extra_args=a.extra, device=device,
            log_path=os.path.join(a.log_dir, f"sglang_server_{i}.log"), api_key=key,
            quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype))

    def stop_all() -> None:
        for s in servers:
            launch.stop_process(s)

    def on_signal(*_):
        stop_all()
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for s in servers:
            http.wait_healthy(s, a.timeout_s)
    except Exception as e:  # noqa: BLE001 - report, stop the others, fail
        print(f"error: {e}", file=sys.stderr, flush=True)
        stop_all()
        return 1
    urls = [s.url for s in servers]
    print("\n".join(urls), flush=True)
    if a.url_file:
        tmp = a.url_file + ".tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(urls) + "\n")
        os.replace(tmp, a.url_file)  # readers never see a half-written file
    while True:  # keep the servers; a dead one ends this command with its exit code
        for s in servers:
            code = s.exit_code()
            if code is not None:
                print(f"error: SGLang server {s.url} exited with code {code}", file=sys.stderr, flush=True)
                stop_all()
                return 1
        time.sleep(5)


if __name__ == "__main__":
    sys.exit(main())
