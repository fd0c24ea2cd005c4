"""The lock command: writes the image's lock files, requirements/lock/ (docs/docker.md "The lock").

    python -m pip install uv            # once; the header of each lock names the uv that wrote it
    python tools/lock_requirements.py   # needs the package index (PyPI)

1. ONE resolution (``uv pip compile --generate-hashes``, for the image's Python 3.12 on
   manylinux_2_39 x86_64) of every requirement file that the Dockerfile installs with its
   dependencies: the cumulative environment the image ends with, so a later step can never
   swap what an earlier one installed. ``requirements/uv.toml`` gives the metadata of Transformer
   Engine's torch extension (an sdist compiled in the image), so nothing is built here.
2. Per Dockerfile step (``STEPS``), the part of that environment the step installs: the closure of
   the step's input files within it (resolved again under the whole lock as constraints), less what
   earlier steps installed. The Dockerfile installs each with ``pip install --require-hashes
   --no-deps``. SGLang is locked alone, without dependencies (its torchaudio/torchcodec pins are
   built for other torch versions; its runtime dependencies are in requirements/sglang-runtime.txt).
3. ``requirements/lock/metadata.json``: the Requires-Dist of every locked distribution, as the
   image's pip reads it from the locked files (:func:`read_requires_dist`), so the suite checks OFFLINE
   that the locked set meets every declared requirement, extras included (tests/test_dockerfile.py).

Every lock file's header records ``inputs-sha256``, a hash of the input files and of these
settings (:func:`inputs_digest`); the suite fails when an input changed without a new lock.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCK_DIR = "requirements/lock"
UV_CONFIG = "requirements/uv.toml"
PYTHON_VERSION = "3.12"  # Ubuntu 24.04's, the image's venv
PYTHON_PLATFORM = "x86_64-manylinux_2_39"  # Ubuntu 24.04: glibc 2.39
# (lock file, input files, with dependencies), in the Dockerfile's order.
STEPS = (
    ("bootstrap.txt", ("requirements/bootstrap.txt",), True),
    ("torch.txt", ("requirements/torch.txt",), True),
    ("te.txt", ("requirements/te.txt",), True),
    ("sglang.txt", ("requirements/sglang.txt",), False),
    ("image.txt", ("requirements/base.txt", "requirements/sglang-runtime.txt"), True),
)
_ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==(\S+)")


def input_files() -> list:
    return [UV_CONFIG, *(f for _, files, _ in STEPS for f in files)]


def inputs_digest(root: str = ROOT) -> str:
    """sha256 of the input files' contents and of the resolution settings."""
    h = hashlib.sha256(f"python={PYTHON_VERSION} platform={PYTHON_PLATFORM} steps={STEPS!r}\n".encode())
    for path in input_files():
        with open(os.path.join(root, path), "rb") as f:
            h.update(f"{path}\n".encode() + f.read() + b"\n")
    return h.hexdigest()


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_lock(text: str) -> dict:
    """{canonical name: {"version", "hashes", "block"}} of a uv/pip-compile style lock; a name
    locked twice raises ValueError."""
    entries, current = {}, None
    for line in text.splitlines():
        m = _ENTRY.match(line)
        if m:
            name = canonical(m.group(1))
            if name in entries:
                raise ValueError(f"{name} is locked twice")
            current = entries[name] = {"version": m.group(3), "hashes": [], "block": [line]}
        elif current is not None and line.startswith((" ", "\t")):
            current["block"].append(line)
            current["hashes"] += re.findall(r"--hash=sha256:([0-9a-f]{64})", line)
        elif line.strip() and not line.startswith("#"):
            raise ValueError(f"unexpected lock line {line!r}")
    return entries


def header_digest(text: str) -> str | None:
    m = re.search(r"^# inputs-sha256: ([0-9a-f]{64})$", text, re.M)
    return m.group(1) if m else None


def _uv(uv: str, args: list, out: str, constraint: str | None = None, deps: bool = True) -> dict:
    cmd = [uv, "pip", "compile", "--config-file", os.path.join(ROOT, UV_CONFIG), "--python-version",
           PYTHON_VERSION, "--python-platform", PYTHON_PLATFORM, "--generate-hashes", "--no-header",
           "--quiet", "--index-url", "https://pypi.org/simple", *args, "-o", out]
    if constraint:
        cmd += ["-c", constraint]
    if not deps:
        cmd.append("--no-deps")
    subprocess.run(cmd, check=True, cwd=ROOT)
    with open(out, encoding="utf-8") as f:
        text = f.read()
    if constraint:  # the temporary file's name would make every lock differ
        text = text.replace(f"-c {constraint}", "-c (the whole image's resolution)")
    return parse_lock(text)


def _write(path: str, step_files: tuple, entries: dict, digest: str, uv_version: str, deps: bool) -> None:
    how = "with dependencies, less earlier steps" if deps else "alone, installed --no-deps"
    lines = [f"# The image's lock for `{' '.join(step_files)}` ({how}). Generated by",
             "# `python tools/lock_requirements.py` (docs/docker.md \"The lock\"); do not edit by hand.",
             f"# inputs-sha256: {digest}",
             f"# python {PYTHON_VERSION}, platform {PYTHON_PLATFORM}, {uv_version}"]
    for name in sorted(entries):
        lines += entries[name]["block"]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


IMAGE_PIP = "25.3"  # requirements/bootstrap.txt: the pip of the image reads the metadata
# every manylinux tag up to glibc 2.39 (pip does not expand one --platform)
IMAGE_PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(39, 16, -1)] + ["manylinux2014_x86_64"]


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # this machine's pip.conf (local mirrors) is not the image's
    return env


def _image_pip(work: str) -> str:
    """Path of the image's pip, run from its wheel (``python <wheel>/pip``)."""
    dest = os.path.join(work, "pip-wheel")
    subprocess.run([sys.executable, "-m", "pip", "download", "--isolated", "--no-deps", "--only-binary=:all:",
                    f"pip=={IMAGE_PIP}", "-d", dest], check=True, env=_clean_env(), capture_output=True)
    (wheel,) = [f for f in os.listdir(dest) if f.endswith(".whl")]
    return os.path.join(dest, wheel, "pip")


def _configured_metadata() -> dict:
    import tomllib

    with open(os.path.join(ROOT, UV_CONFIG), "rb") as f:
        return {canonical(d["name"]): d for d in tomllib.load(f).get("dependency-metadata", [])}


def read_requires_dist(locked: dict, work: str) -> dict:
    """{name: Requires-Dist} of every locked distribution: what the image's pip reads from the locked
    files (``pip install --dry-run --report --no-deps --require-hashes`` for the image's Python and
    platform; metadata by HTTP range requests), and requirements/uv.toml's for the sdists it gives."""
    given = {n: d for n, d in _configured_metadata().items() if n in locked}
    lock = os.path.join(work, "metadata-input.txt")
    with open(lock, "w", encoding="utf-8") as f:
        for name in sorted(set(locked) - set(given)):
            f.write("\n".join(locked[name]["block"]) + "\n")
    report = os.path.join(work, "report.json")
    plats = [a for p in IMAGE_PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, _image_pip(work), "install", "--isolated", "--dry-run", "--report", report,
                    "--quiet", "--no-deps", "--ignore-installed", "--require-hashes", "--use-feature=fast-deps",
                    "--target", os.path.join(work, "target"), "--python-version", PYTHON_VERSION,
                    "--implementation", "cp", "--abi", "cp" + PYTHON_VERSION.replace(".", ""), *plats,
                    "--only-binary=:all:", "--index-url", "https://pypi.org/simple", "-r", lock],
                   check=True, env=_clean_env())
    with open(report, encoding="utf-8") as f:
        items = json.load(f)["install"]
    requires = {canonical(i["metadata"]["name"]): i["metadata"].get("requires_dist") or [] for i in items}
    versions = {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items}
    for name, meta in given.items():
        requires[name], versions[name] = list(meta["requires-dist"]), meta["version"]
    wrong = {n: (versions.get(n), e["version"]) for n, e in locked.items() if versions.get(n) != e["version"]}
    if wrong:
        raise RuntimeError(f"pip's report does not match the lock (read, locked): {wrong}")
    return requires


def write_metadata(path: str, locked: dict, work: str) -> None:
    requires = read_requires_dist(locked, work)
    data = {n: {"version": locked[n]["version"], "requires_dist": requires[n]} for n in sorted(locked)}
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"inputs-sha256": inputs_digest(), "distributions": data}, f, indent=1, sort_keys=True)
        f.write("\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--uv", default=shutil.which("uv") or "uv", help="the uv executable")
    args = parser.parse_args(argv)
    uv_version = subprocess.run([args.uv, "--version"], check=True, capture_output=True, text=True).stdout.strip()
    digest = inputs_digest()
    work = tempfile.mkdtemp(prefix="hapo-lock-")
    resolved_files = [f for _, files, deps in STEPS if deps for f in files]
    full_path = os.path.join(work, "full.txt")
    full = _uv(args.uv, resolved_files, full_path)
    done, everything = set(), {}
    for i, (lock, files, deps) in enumerate(STEPS):
        part = _uv(args.uv, list(files), os.path.join(work, lock), constraint=full_path if deps else None, deps=deps)
        if deps:
            assert all(full[n]["version"] == e["version"] for n, e in part.items()), f"{lock} left the lock"
        mine = {n: e for n, e in part.items() if n not in done}
        if i == len(STEPS) - 1:  # the last step installs the rest of the environment
            mine.update({n: e for n, e in full.items() if n not in done and n not in mine})
        _write(os.path.join(ROOT, LOCK_DIR, lock), files, mine, digest, uv_version, deps)
        done |= set(mine)
        everything.update(mine)
        print(f"{LOCK_DIR}/{lock}: {len(mine)} distributions")
    write_metadata(os.path.join(ROOT, LOCK_DIR, "metadata.json"), everything, work)
    print(f"{LOCK_DIR}/metadata.json: Requires-Dist of {len(everything)} distributions")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
