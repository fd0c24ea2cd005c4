"""The "already prepared" marker of the examples' offline data directories.

An example's ``prepare.py`` writes its settings to ``<out>/prepared.json`` when it finishes and
skips the work next time only if the settings are the same: a directory prepared with other
settings (or half-written, with no marker) is rebuilt, so a changed flag can never silently
train on stale data. A marker that does not match is deleted before the rebuild starts, so a
rebuild that stops half-way leaves no marker behind for the old settings to match.

The settings include ``code_sha256`` (`code_fingerprint`): a hash of the source files that write
the data, so a directory prepared by older code is rebuilt too (seen: a data directory prepared
before ``prepare.py`` added a field kept being reused, and EDGE-GRPO's solution branch found no
solution in any row).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os

MARKER = "prepared.json"
_IGNORED = ("force",)  # how the directory was requested, not what it holds


def code_fingerprint(*sources: str) -> str:
    """A short hash of ``sources``' bytes: file paths, or dotted names of modules (plain ``.py``
    files, located without importing them or their packages, so that the check stays cheap)."""
    digest = hashlib.sha256()
    for source in sources:
        with open(source if source.endswith(".py") else _module_path(source), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def _module_path(name: str) -> str:
    top, *rest = name.split(".")
    return os.path.join(importlib.util.find_spec(top).submodule_search_locations[0], *rest) + ".py"


def _settings(settings: dict) -> dict:
    return {k: v for k, v in settings.items() if k not in _IGNORED}


def already_prepared(out_dir: str, settings: dict, force: bool = False) -> bool:
    """True when ``out_dir`` was completely prepared with exactly ``settings``; prints why not."""
    marker = os.path.join(out_dir, MARKER)
    if not os.path.exists(marker):
        return False
    with open(marker) as f:
        done = json.load(f)
    if not force and _settings(done) == _settings(settings):
        print(f"{out_dir}: already prepared ({marker})")
        return True
    changed = sorted(k for k in set(_settings(done)) | set(_settings(settings))
                     if done.get(k) != settings.get(k))
    print(f"{out_dir}: " + ("rebuilding (forced)" if force else
                             f"prepared with other settings ({', '.join(changed)}), rebuilding"))
    os.remove(marker)  # the files are about to change: the old settings must not match them again
    return False


def mark_prepared(out_dir: str, settings: dict) -> None:
    """Record that ``out_dir`` is complete for ``settings`` (call last, after every file is written)."""
    with open(os.path.join(out_dir, MARKER), "w") as f:
        json.dump(_settings(settings), f, indent=1)
