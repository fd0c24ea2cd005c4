"""Replays the Dockerfile's pip steps with pip's own resolver in dry-run mode (tests/test_dockerfile.py).

`docker build` cannot run in CI, but its dependency steps can: each `pip install` of a RUN line is
resolved with `pip install --dry-run --report` for the image's Python and platform, by the pip
version the Dockerfile installs, under the constraints the image has at that step:

- the constraints file that step 1 writes (`keep-torch.txt`), computed from step 1's report with
  the Dockerfile's own `grep -iE` pattern, from the `ENV PIP_CONSTRAINT=...keep-torch.txt` line on;
- the `==` pins of the requirement files earlier steps installed (what the image promises: a later
  step that needs another version of one does not resolve, where the image would silently swap it).

A later step may still replace an unpinned dependency an earlier one chose (pip does that too), so
the replay ends with `pip check` over the final set: every installed distribution's requirements
(for the image's markers) are met by what the last step left. `--no-deps` installs are resolved
alone (their metadata still enters that check). A requirement that exists only as an sdist built in
the image (Transformer Engine's torch extension) is given to pip as a metadata-only local wheel
with the requirements its build declares.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

IMAGE_PYTHON = "3.12"
# Ubuntu 24.04 has glibc 2.39: every manylinux tag up to it (pip does not expand one --platform).
IMAGE_PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(39, 16, -1)] + ["manylinux2014_x86_64"]
# Requires-Dist of sdists compiled in the image, as their build computes them for the image's torch
# (transformer_engine_torch 2.11.0's PKG-INFO lists transformer_engine_cu12; its setup.py picks the
# cu13 core for a CUDA 13 torch).
BUILT_SDISTS = {
    ("transformer-engine-torch", "2.11.0"): ["torch>=2.1", "einops", "onnxscript", "onnx",
                                             "packaging", "pydantic", "transformer_engine_cu13==2.11.0"],
}


def image_marker_env() -> dict:
    env = default_environment()
    env.update(python_version=IMAGE_PYTHON, python_full_version=IMAGE_PYTHON + ".3",
               implementation_name="cpython", platform_python_implementation="CPython",
               sys_platform="linux", platform_system="Linux", platform_machine="x86_64",
               os_name="posix")
    return env


def pip_steps(instructions):
    """[(argv after `pip install`, constrained)] for every pip install of the RUN lines in order,
    `constrained` telling whether the keep-torch constraints file is active at that step."""
    steps, constrained = [], False
    for kw, arg in instructions:
        if kw == "ENV" and re.search(r"PIP_CONSTRAINT=.*keep-torch\.txt", arg):
            constrained = True
        if kw != "RUN":
            continue
        for words in _commands(arg):
            while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value before the command
                words = words[1:]
            if words[:2] == ["pip", "install"]:
                steps.append((words[2:], constrained))
    return steps


def _commands(run):
    from tests.test_dockerfile import shell_commands
    return shell_commands(run)


def freeze_pattern(instructions) -> re.Pattern:
    """The `grep -iE '...'` that step 1 applies to `pip list --format=freeze`."""
    for kw, arg in instructions:
        m = re.search(r"pip list --format=freeze\s*\|\s*grep -iE '([^']+)'", arg) if kw == "RUN" else None
        if m:
            return re.compile(m.group(1), re.I)
    raise AssertionError("the Dockerfile writes no keep-torch constraints from `pip list --format=freeze`")


def image_pip_version(instructions) -> str:
    for kw, arg in instructions:
        m = re.search(r"pip install pip==(\S+)", arg) if kw == "RUN" else None
        if m:
            return m.group(1)
    raise AssertionError("the Dockerfile does not pin pip")


def _clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # this machine's pip.conf (caps, local mirrors) is not the image's
    return env


class PipUnavailable(Exception):
    """The index could not be reached (the test skips with this reason)."""


def fetch_pip(version: str, workdir: str) -> str:
    """Path of pip==version's wheel (pip runs from its wheel: `python <wheel>/pip`)."""
    dest = os.path.join(workdir, "pip-wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--isolated", "--no-deps",
                           "--only-binary=:all:", f"pip=={version}", "-d", dest],
                          capture_output=True, text=True, env=_clean_env())
    if proc.returncode != 0:
        raise PipUnavailable(f"`pip download pip=={version}` failed: {proc.stderr.strip()[-400:]}")
    (wheel,) = [f for f in os.listdir(dest) if f.endswith(".whl")]
    return os.path.join(dest, wheel, "pip")


def build_metadata_wheels(workdir: str) -> str:
    """A find-links folder with one metadata-only wheel per BUILT_SDISTS entry."""
    folder = os.path.join(workdir, "built-sdists")
    os.makedirs(folder, exist_ok=True)
    for (name, version), requires in BUILT_SDISTS.items():
        dist = f"{name.replace('-', '_')}-{version}"
        meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                        *(f"Requires-Dist: {r}\n" for r in requires)])
        wheel = "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        with zipfile.ZipFile(os.path.join(folder, f"{dist}-py3-none-any.whl"), "w") as z:
            z.writestr(f"{dist}.dist-info/METADATA", meta)
            z.writestr(f"{dist}.dist-info/WHEEL", wheel)
            z.writestr(f"{dist}.dist-info/RECORD", "")
    return folder


def dry_run(pip: str, args: list, constraints: list, workdir: str, find_links: str, root: str) -> dict:
    """pip's --report of one step; AssertionError with pip's error when it does not resolve."""
    report = os.path.join(workdir, "report.json")
    cons = []
    for i, lines in enumerate(constraints):
        path = os.path.join(workdir, f"constraints-{i}.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        cons += ["-c", path]
    plats = [a for p in IMAGE_PLATFORMS for a in ("--platform", p)]
    # installs that do not need a source tree: `-e .` is the package itself, installed --no-deps
    args = [a for a in args if a not in ("--no-build-isolation",)]
    cmd = [sys.executable, pip, "install", "--isolated", "--disable-pip-version-check", "--dry-run", "--report", report,
           "--use-feature=fast-deps",  # metadata by HTTP range requests: no multi-GB wheel downloads
           "--target", os.path.join(workdir, "target"), "--python-version", IMAGE_PYTHON,
           "--implementation", "cp", "--abi", "cp" + IMAGE_PYTHON.replace(".", ""), *plats,
           "--only-binary=:all:", "--find-links", find_links, *cons, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=_clean_env())
    if proc.returncode != 0:
        err = proc.stderr
        if re.search(r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|"
                     r"Network is unreachable|ConnectTimeout|ReadTimeout", err):
            raise PipUnavailable(f"the package index is unreachable: {err.strip()[-300:]}")
        why = "\n".join(l for l in (proc.stdout + err).splitlines()
                        if not re.match(r"\s*(Collecting|Obtaining|Using cached|Downloading|WARNING: pip is using)", l))
        raise AssertionError(f"`pip install {' '.join(args)}` does not resolve:\n{why.strip()[-4000:]}")
    with open(report, encoding="utf-8") as f:
        return json.load(f)


def replay(instructions, root: str, workdir: str | None = None):
    """Resolve every pip step of the Dockerfile in order. Returns (installed {name: version},
    requires {name: [Requires-Dist]}, [(step args, seconds)]). AssertionError on the first step
    that does not resolve; PipUnavailable when the index cannot be reached."""
    import time
    workdir = workdir or tempfile.mkdtemp(prefix="docker-resolve-")
    pip = fetch_pip(image_pip_version(instructions), workdir)
    links = build_metadata_wheels(workdir)
    freeze = freeze_pattern(instructions)
    installed, requires, keep, timings, promised = {}, {}, None, [], []
    for args, constrained in pip_steps(instructions):
        if args and args[0].startswith("pip=="):  # the pip/setuptools/wheel bootstrap
            continue
        if "-e" in args:  # the package itself, --no-deps from the source tree
            continue
        t0 = time.perf_counter()
        cons = [promised] if promised else []
        if constrained:
            assert keep is not None, "PIP_CONSTRAINT names keep-torch.txt before step 1 wrote it"
            cons.append(keep)
        report = dry_run(pip, args, cons, workdir, links, root)
        promised += [f"{n}=={v}" for f in _requirement_files(args) for n, v in _file_pins(root, f).items()]
        timings.append((" ".join(args), time.perf_counter() - t0))
        for item in report["install"]:
            meta = item["metadata"]
            name = canonicalize_name(meta["name"])
            installed[name] = meta["version"]
            requires[name] = meta.get("requires_dist") or []
        if keep is None:  # step 1: what `pip list --format=freeze | grep -iE ...` keeps
            keep = [f"{item['metadata']['name']}=={item['metadata']['version']}"
                    for item in report["install"]
                    if freeze.match(f"{item['metadata']['name']}=={item['metadata']['version']}")]
    return installed, requires, timings


def _requirement_files(args: list) -> list:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == "-r"]


def _file_pins(root: str, path: str) -> dict:
    pins = {}
    with open(os.path.join(root, path), encoding="utf-8") as f:
        for line in f:
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                req = Requirement(line)
                for spec in req.specifier:
                    if spec.operator == "==":
                        pins[canonicalize_name(req.name)] = spec.version
    return pins


def unmet_requirements(installed: dict, requires: dict, left_out: dict) -> list:
    """`pip check` over the final image: every Requires-Dist (markers for the image, no extras)
    of every installed distribution met, except the (package, dependency) pairs of left_out."""
    env = image_marker_env()
    problems = []
    for name, reqs in sorted(requires.items()):
        for line in reqs:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue
            dep = canonicalize_name(req.name)
            if dep in left_out.get(name, ()):
                continue
            have = installed.get(dep)
            if have is None or not req.specifier.contains(Version(have), prereleases=True):
                problems.append(f"{name}=={installed[name]} requires {line}, the image has "
                                f"{dep}=={have}")
    return problems
