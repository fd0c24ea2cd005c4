"""The per-run API key of the SGLang rollout servers (docs/multinode.md).

A server started with ``--enable-custom-logit-processor`` runs code sent in a request, and its
weight endpoints load pickled tensors and arbitrary paths: whoever can reach the port must also
hold the key. One secret serves as both SGLang's ``--api-key`` (``/generate`` and the other plain
endpoints) and ``--admin-api-key`` (weights, memory, cache), sent as ``Authorization: Bearer KEY``.

Where the key comes from, first match wins (:func:`resolve_api_key`):

1. ``$HAPO_ROLLOUT_API_KEY`` (servers a user started with ``--api-key`` / ``--admin-api-key``);
2. the key file (``<run_dir>/rollout_api_key`` for the trainer), when it exists;
3. a fresh ``secrets`` key, written to the key file when one is named.

The key file is created owner-only (mode 0600 from the ``open`` call on, never widened later) and
refused when other users can read it. The key never goes on a command line (``ps`` shows those to
every user of the node), into ``config.yaml`` or into a log: launched processes get it through
their environment and their output is written with it replaced (:func:`redact`).
"""

from __future__ import annotations

import os
import secrets
import stat
import time
from typing import Optional

#: environment variable holding the key (user-started servers, and the launched processes' own)
API_KEY_ENV = "HAPO_ROLLOUT_API_KEY"
#: name of the key file in a run directory
KEY_FILE_NAME = "rollout_api_key"
REDACTED = "<rollout-api-key-redacted>"  # distinct from SGLang's own "<redacted>"
_READ_WAIT_S = 10.0  # another node may have created the file an instant before writing the key


def new_api_key() -> str:
    """A fresh random key (256 bits, URL-safe characters)."""
    return secrets.token_urlsafe(32)


def auth_headers(key: Optional[str]) -> dict:
    """The request headers that carry ``key`` (none without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def write_key_file(path: str, key: str) -> None:
    """Create ``path`` holding ``key``, readable by its owner only. Raises ``FileExistsError`` when
    it exists (two nodes racing: the loser reads the winner's key)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_key_file(path: str, wait_s: float = _READ_WAIT_S) -> str:
    """The key in ``path``; ``PermissionError`` when group or others may read it (``chmod 600``)."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise PermissionError(f"API key file {path} is readable by other users (mode {mode:o}): run "
                              f"`chmod 600 {path}`")
    deadline = time.monotonic() + wait_s
    while True:
        with open(path) as f:
            key = f.read().strip()
        if key:
            return key
        if time.monotonic() >= deadline:
            raise ValueError(f"API key file {path} is empty")
        time.sleep(0.2)


def resolve_api_key(key_file: Optional[str] = None, *, create: bool = False) -> Optional[str]:
    """The key to use: ``$HAPO_ROLLOUT_API_KEY``, else the one in ``key_file`` if it exists, else
    (``create``) a new one, written to ``key_file`` when given; ``None`` when there is none."""
    key = os.environ.get(API_KEY_ENV, "").strip()
    if key:
        return key
    if key_file and os.path.exists(key_file):
        return read_key_file(key_file)
    if not create:
        return None
    key = new_api_key()
    if key_file:
        try:
            write_key_file(key_file, key)
        except FileExistsError:
            return read_key_file(key_file)
    return key


def redact(data: bytes, key: Optional[str]) -> bytes:
    """``data`` with every occurrence of ``key`` replaced."""
    return data.replace(key.encode(), REDACTED.encode()) if key else data


__all__ = ["API_KEY_ENV", "KEY_FILE_NAME", "REDACTED", "new_api_key", "auth_headers", "write_key_file",
           "read_key_file", "resolve_api_key", "redact"]
