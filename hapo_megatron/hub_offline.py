"""Offline first: find out in a moment whether the Hugging Face hub can be reached, and when it
cannot, put huggingface_hub, datasets and transformers in their offline mode before they try, so
a command reads what the local cache has, or fails at once saying what to pass instead, rather
than spending a minute in connection retries (docs/troubleshooting.md, "Offline machines").

The probe is one TCP connection to the hub's host (``HF_ENDPOINT``, else huggingface.co) with a
short timeout; ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` set to a
true value (or huggingface_hub's own flag, once imported) skip it.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Optional
from urllib.parse import urlsplit

PROBE_TIMEOUT_S = 3.0
_TRUE = ("1", "ON", "YES", "TRUE")
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def _endpoint() -> tuple[str, int]:
    url = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


def offline_reason(timeout_s: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """Why the hub is out of reach (an offline variable, or the probe's error), or None when it answers."""
    for var in _OFFLINE_VARS:
        if os.environ.get(var, "").upper() in _TRUE:
            return f"{var}={os.environ[var]}"
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None and hub.HF_HUB_OFFLINE:  # set in this process after the import
        return "huggingface_hub's offline mode"
    host, port = _endpoint()
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as err:
        return f"the hub ({host}:{port}) cannot be reached: {err}"
    return None


def go_offline_if_unreachable(timeout_s: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """When the hub is out of reach: the offline variables set for this process and its children,
    and the offline flags of huggingface_hub and datasets if they were imported already (they read
    the variables once, at import). Returns the reason (None: online, nothing changed)."""
    reason = offline_reason(timeout_s)
    if reason is None:
        return None
    for var in _OFFLINE_VARS:
        os.environ[var] = "1"
    if "huggingface_hub.constants" in sys.modules:
        sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE = True
    if "datasets.config" in sys.modules:
        cfg = sys.modules["datasets.config"]
        cfg.HF_HUB_OFFLINE = cfg.HF_DATASETS_OFFLINE = True
    return reason


__all__ = ["PROBE_TIMEOUT_S", "go_offline_if_unreachable", "offline_reason"]
