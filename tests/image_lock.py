"""Offline checks of the image's lock (requirements/lock/, written by tools/lock_requirements.py;
docs/docker.md "The lock"), used by tests/test_dockerfile.py. Nothing here reaches the network:
the lock records every locked file's hash and every locked distribution's Requires-Dist.

- :func:`lock_problems`: each lock file was written from today's inputs (``inputs-sha256``), every
  entry is an ``==`` pin with hashes, no distribution is locked twice, every requirement of a step's
  input files is met by what that step and the earlier ones install, and no later step installs
  again what the Dockerfile freezes after the torch step (its ``grep -iE`` pattern).
- :func:`unmet_requirements`: ``pip check`` over the locked set for the image's markers, with the
  extras that the inputs and the locked distributions request (an extra's requirements count).
"""

import importlib.util
import json
import os
from collections import defaultdict
from functools import lru_cache

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE_PYTHON = "3.12"
TORCH_LOCK = "torch.txt"  # the step after which the Dockerfile freezes the torch stack


def lock_tool():
    """tools/lock_requirements.py as a module (its STEPS, digest and lock parser)."""
    spec = importlib.util.spec_from_file_location("lock_requirements", os.path.join(ROOT, "tools",
                                                                                    "lock_requirements.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def image_marker_env() -> dict:
    env = default_environment()
    env.update(python_version=IMAGE_PYTHON, python_full_version=IMAGE_PYTHON + ".3",
               implementation_name="cpython", platform_python_implementation="CPython",
               sys_platform="linux", platform_system="Linux", platform_machine="x86_64",
               os_name="posix")
    return env


def read_input(root: str, path: str) -> list:
    """The requirements of one input file (comments dropped)."""
    reqs = []
    with open(os.path.join(root, path), encoding="utf-8") as f:
        for line in f:
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                reqs.append(Requirement(line))
    return reqs


def read_locks(root: str, tool) -> dict:
    """{lock file name: raw text} in the Dockerfile's order."""
    out = {}
    for lock, _, _ in tool.STEPS:
        with open(os.path.join(root, tool.LOCK_DIR, lock), encoding="utf-8") as f:
            out[lock] = f.read()
    return out


def read_metadata(root: str, tool) -> dict:
    with open(os.path.join(root, tool.LOCK_DIR, "metadata.json"), encoding="utf-8") as f:
        return json.load(f)


def lock_problems(texts: dict, inputs: dict, digest: str, freeze, tool) -> list:
    """What is wrong with the lock files ``texts`` ({lock: text}) for the input files ``inputs``
    ({path: [Requirement]}) whose digest is ``digest``; ``freeze`` is the Dockerfile's pattern of
    the packages frozen after the torch step."""
    problems, installed, where, frozen = [], {}, {}, set()
    for lock, files, _ in tool.STEPS:
        text = texts[lock]
        if tool.header_digest(text) != digest:
            problems.append(f"{lock} was not generated from today's inputs (inputs-sha256 {tool.header_digest(text)} "
                            f"!= {digest}): run `python tools/lock_requirements.py`")
        try:
            entries = tool.parse_lock(text)
        except ValueError as e:
            problems.append(f"{lock}: {e}")
            continue
        for name, entry in entries.items():
            if not entry["hashes"]:
                problems.append(f"{lock}: {name}=={entry['version']} has no --hash")
            if name in where:
                problems.append(f"{name} is locked by {where[name]} and again by {lock}")
            if lock == TORCH_LOCK and freeze.match(f"{name}=={entry['version']}"):
                frozen.add(name)  # in keep-torch.txt: a later step may not install it again
            elif name in frozen:
                problems.append(f"{lock} installs {name}=={entry['version']}, which the torch step froze")
            where.setdefault(name, lock)
            installed.setdefault(name, entry["version"])
        for path in files:
            for req in inputs[path]:
                have = installed.get(canonicalize_name(req.name))
                if have is None or not req.specifier.contains(Version(have), prereleases=True):
                    problems.append(f"{path} requires {req}, the lock up to {lock} has {req.name}=={have}")
    return problems


def locked_versions(texts: dict, tool) -> dict:
    out = {}
    for text in texts.values():
        out.update({n: e["version"] for n, e in tool.parse_lock(text).items()})
    return out


@lru_cache(maxsize=None)
def _parsed(line: str) -> Requirement:
    """A Requires-Dist line parsed once (the checks walk ~2000 of them several times)."""
    return Requirement(line)


def requested_extras(inputs: list, requires: dict, env: dict) -> dict:
    """{name: extras} asked for by the input requirements and, transitively, by the active
    requirements of the locked distributions."""
    extras = defaultdict(set)
    for req in inputs:
        extras[canonicalize_name(req.name)] |= set(req.extras)
    changed = True
    while changed:
        changed = False
        for name, lines in requires.items():
            for line in lines:
                req = _parsed(line)
                dep = canonicalize_name(req.name)
                if req.extras and _active(req, extras[name], env) and not set(req.extras) <= extras[dep]:
                    extras[dep] |= set(req.extras)
                    changed = True
    return extras


def _active(req: Requirement, extras: set, env: dict) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in {"", *extras})


def unmet_requirements(installed: dict, requires: dict, left_out: dict, extras: dict | None = None) -> list:
    """`pip check` over the image: every Requires-Dist of every installed distribution that is
    active for the image's markers and the requested ``extras`` ({name: {extra}}) is met, except
    the (package, dependency) pairs of ``left_out``."""
    env = image_marker_env()
    extras = extras or {}
    problems = []
    for name, reqs in sorted(requires.items()):
        for line in reqs:
            req = _parsed(line)
            if not _active(req, extras.get(name, set()), env):
                continue
            dep = canonicalize_name(req.name)
            if dep in left_out.get(name, ()):
                continue
            have = installed.get(dep)
            if have is None or not req.specifier.contains(Version(have), prereleases=True):
                problems.append(f"{name}=={installed[name]} requires {line}, the image has "
                                f"{dep}=={have}")
    return problems
