"""Checks of the Dockerfile and the requirement files it copies (`docker build` cannot run in CI).

Offline: the Dockerfile parses (known instructions, only ARG before the first FROM, a CUDA devel
base), every COPY source exists, every requirement line is a valid PEP 508 requirement, the torch
stack comes only from requirements/torch.txt (+ Transformer Engine from te.txt, built against it)
and is then frozen by a constraints file ADDED to the base image's, the stack is coherent by the
packages' declared requirements (recorded below from their PyPI metadata), SGLang and the package
go in with --no-deps, the build's smoke test imports every compiled piece, the default command
runs a real config with one rank per GPU, and the pins satisfy setup.cfg. Online (skipped with a
reason when PyPI cannot be reached): every `name==version` pin is a released, non-yanked version
with a file installable on the image's Python (3.12, Linux x86_64).
"""

import configparser
import json
import os
import re
import shlex
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILE = os.path.join(ROOT, "Dockerfile")
INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT",
                "VOLUME", "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK",
                "SHELL", "MAINTAINER"}
# Built against one exact torch: installed only from the files named in TORCH_FILES.
TORCH_STACK = {"torch", "torchvision", "torchaudio", "triton", "pytorch-triton", "torchcodec",
               "torchao", "transformer-engine", "apex"}
TORCH_FILES = {"requirements/torch.txt": {"torch", "torchvision"},
               "requirements/te.txt": {"transformer-engine"}}
IMAGE_PYTHON = (3, 12)  # Python of Ubuntu 24.04 (the CUDA base image)
TESTED_SGLANG = "0.5.23"  # the SGLang this project runs (CPU tests, setup.cfg's sglang extra)
# Declared requirements read from the packages' PyPI metadata (`pip download --no-deps X==V` and
# its METADATA; `pip install --dry-run --report` for the big wheels). Update with the pins.
DECLARED = {
    ("sglang", "0.5.23"): {"torch": "==2.14.1", "sglang-kernel": "==0.4.10", "flashinfer-python": "==0.7.2",
                           "transformers": "==5.19.0"},
    ("sglang-kernel", "0.4.10"): {"torch": "==2.14.1"},
    ("torchvision", "0.29.1"): {"torch": ">=2.14.0"},
    ("megatron-core", "0.16.1"): {"transformer-engine": ">=2.9.0a0,<2.12.0"},  # its `dev` extra
}
COMPILED_IMPORTS = ("transformer_engine.pytorch", "sgl_kernel", "flashinfer", "megatron.core", "sglang")


def parse_dockerfile(path=DOCKERFILE):
    """[(INSTRUCTION, argument text)] with line continuations joined and comments dropped."""
    instructions, buf = [], ""
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.rstrip("\n")
            if not buf and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if buf and line.lstrip().startswith("#"):  # comment inside a continuation
                continue
            if line.rstrip().endswith("\\"):
                buf += line.rstrip()[:-1] + " "
                continue
            buf += line
            keyword, _, rest = buf.strip().partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
            buf = ""
    assert not buf, "Dockerfile ends inside a line continuation"
    return instructions


def copied_requirement_files(instructions):
    """Requirement files referenced with `-r` in RUN lines."""
    files = []
    for kw, arg in instructions:
        if kw == "RUN":
            files += re.findall(r"-r\s+(\S+\.txt)", arg)
    return files


def shell_commands(run):
    """The simple commands of a RUN line as word lists (split at &&, ||, |, ;)."""
    lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    cmds, cur = [], []
    for tok in lexer:
        if tok in ("&&", "||", "|", ";", "&"):
            cmds.append(cur)
            cur = []
        else:
            cur.append(tok)
    return [c for c in cmds + [cur] if c]


def read_requirements(path):
    reqs = []
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                try:
                    reqs.append(Requirement(line))
                except Exception as e:  # noqa: BLE001 - reported with the file and line
                    pytest.fail(f"{path}:{lineno}: invalid requirement {line!r}: {e}")
    return reqs


def pins(reqs):
    """{canonical name: version} of the `==` pins."""
    out = {}
    for r in reqs:
        for spec in r.specifier:
            if spec.operator == "==":
                out[canonicalize_name(r.name)] = spec.version
    return out


@pytest.fixture(scope="module")
def instructions():
    return parse_dockerfile()


@pytest.fixture(scope="module")
def requirement_files(instructions):
    files = copied_requirement_files(instructions)
    assert files, "the Dockerfile installs no requirement file"
    return {f: read_requirements(f) for f in files}


def test_instructions_are_valid_and_from_comes_first(instructions):
    for kw, arg in instructions:
        assert kw in INSTRUCTIONS, f"unknown Dockerfile instruction {kw!r}"
        assert arg, f"{kw} without arguments"
    first = next(i for i, (kw, _) in enumerate(instructions) if kw != "ARG")
    assert instructions[first][0] == "FROM", "only ARG may precede the first FROM"
    args = dict(a.split("=", 1) for kw, a in instructions[:first] if "=" in a)
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], instructions[first][1].split()[0])
    # a devel image: Transformer Engine's torch extension is compiled in the build
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-cudnn-devel-ubuntu24\.04", image), image


def test_copy_sources_exist(instructions):
    for kw, arg in instructions:
        if kw not in ("COPY", "ADD"):
            continue
        parts = [p for p in shlex.split(arg) if not p.startswith("--")]
        assert len(parts) >= 2, f"{kw} {arg}: needs a source and a destination"
        for src in parts[:-1]:
            assert os.path.exists(os.path.join(ROOT, src)), f"{kw} source {src!r} is not in the repo"


def test_requirement_files_are_copied_before_use(instructions):
    copied = [shlex.split(a)[0] for kw, a in instructions if kw == "COPY"]
    for i, (kw, arg) in enumerate(instructions):
        for req in re.findall(r"-r\s+(\S+)", arg) if kw == "RUN" else []:
            earlier = [c for kw2, a in instructions[:i] if kw2 == "COPY"
                       for c in shlex.split(a)[:-1]]
            assert any(req == c or req.startswith(c.rstrip("/") + "/") for c in earlier), (
                f"{req} is used before it is copied (copied: {copied})")


def test_requirement_files_parse_and_only_torch_files_touch_torch(requirement_files):
    assert set(TORCH_FILES) <= set(requirement_files), "torch.txt / te.txt are not installed"
    for path, reqs in requirement_files.items():
        assert reqs, f"{path} is empty"
        names = [canonicalize_name(r.name) for r in reqs]
        assert len(names) == len(set(names)), f"{path}: duplicate requirement"
        bad = (TORCH_STACK & set(names)) - TORCH_FILES.get(path, set())
        assert not bad, f"{path} would reinstall {sorted(bad)} over the image's torch stack"


def test_our_packages_are_pinned(requirement_files):
    for path in ("requirements/base.txt", "requirements/sglang.txt", *TORCH_FILES):
        for r in requirement_files[path]:
            ops = {s.operator for s in r.specifier}
            assert ops == {"=="}, f"{path}: {r} must be pinned with =="


def run_line_problems(instructions):
    """What in the RUN/ENV lines would reinstall torch or install the package with deps."""
    runs = [a for kw, a in instructions if kw == "RUN"]
    envs = " ".join(a for kw, a in instructions if kw == "ENV")
    # installing the torch stack by name: only through the -r files of TORCH_FILES
    problems = []
    for run in runs:
        for words in shell_commands(run):
            if "install" not in words or "pip" not in " ".join(words[:3]):
                continue
            pkgs = {canonicalize_name(re.split(r"[<>=\[ ]", w)[0]) for w in words
                    if not w.startswith("-") and w not in ("pip", "pip3", "install", "python",
                                                           "python3")}
            if TORCH_STACK & pkgs:
                problems.append(f"installs the torch stack: {' '.join(words)}")
            if {"--force-reinstall", "-U", "--upgrade"} & set(words):
                problems.append(f"force/upgrade install: {' '.join(words)}")
    if not ("PIP_CONSTRAINT=" in envs and "keep-torch.txt" in envs):
        problems.append("no PIP_CONSTRAINT pinning the installed torch stack")
    elif "${PIP_CONSTRAINT:+" not in envs:
        problems.append("PIP_CONSTRAINT replaces the base image's constraints instead of adding to them")
    if not any("pip list --format=freeze" in r and "keep-torch.txt" in r and "requirements/torch.txt" in r
               for r in runs):
        problems.append("the torch constraints file is not generated right after installing torch.txt")
    if not any("--no-build-isolation -r requirements/te.txt" in r for r in runs):
        problems.append("Transformer Engine is not built against the installed torch (--no-build-isolation)")
    if not any(re.search(r"pip install --no-deps -r requirements/sglang\.txt", r) for r in runs):
        problems.append("sglang is not installed with --no-deps")
    if not any(re.search(r"pip install --no-deps (-e )?\.(\s|$)", r) for r in runs):
        problems.append("the package is not installed with pip install --no-deps")
    if not any("torch-version.txt" in r and "torch.__version__" in r for r in runs[1:]):
        problems.append("no final check that torch is unchanged")
    return problems


def test_run_lines_keep_torch_and_install_package_without_deps(instructions):
    assert run_line_problems(instructions) == []


def test_constraint_replacing_the_base_images_is_caught(instructions):
    edited = [(kw, a.replace("${PIP_CONSTRAINT:+${PIP_CONSTRAINT} }", "")) for kw, a in instructions]
    assert any("replaces the base image" in p for p in run_line_problems(edited))


@pytest.mark.parametrize("bad", [
    "RUN pip install torch==2.5.1",
    "RUN python -m pip install --upgrade transformers",
    "RUN pip install -r requirements/base.txt && pip install --force-reinstall torchvision",
])
def test_run_line_checks_catch_torch_reinstalls(instructions, bad):
    kw, _, arg = bad.partition(" ")
    assert run_line_problems(instructions + [(kw, arg)])


def test_run_line_checks_catch_missing_no_deps(instructions):
    edited = [(kw, a.replace("pip install --no-deps -e .", "pip install -e ."))
              for kw, a in instructions]
    assert any("--no-deps" in p for p in run_line_problems(edited))


def _all_pins(requirement_files):
    pinned = {}
    for reqs in requirement_files.values():
        pinned.update(pins(reqs))
    return pinned


def stack_problems(pinned: dict) -> list:
    """Every pinned package whose declared requirements (DECLARED) another pin violates."""
    problems = []
    for (name, version), needs in DECLARED.items():
        if pinned.get(name) != version:
            problems.append(f"{name}=={pinned.get(name)} is pinned but DECLARED records {name}=={version}: "
                            "read the new version's metadata and update DECLARED")
            continue
        for dep, spec in needs.items():
            have = pinned.get(dep)
            if have is None or not SpecifierSet(spec).contains(have, prereleases=True):
                problems.append(f"{name}=={version} declares {dep}{spec}, the image pins {dep}=={have}")
    return problems


def test_stack_is_coherent_by_declared_requirements(requirement_files):
    pinned = _all_pins(requirement_files)
    assert pinned["sglang"] == TESTED_SGLANG
    assert stack_problems(pinned) == []


def test_stack_check_catches_a_mismatched_pair(requirement_files):
    pinned = _all_pins(requirement_files)
    assert any("transformer-engine" in p for p in stack_problems({**pinned, "transformer-engine": "2.13.0"}))
    assert any("declares torch==2.14.1" in p for p in stack_problems({**pinned, "torch": "2.11.0"}))


def test_sglang_runtime_file_is_for_the_pinned_sglang(requirement_files):
    with open(os.path.join(ROOT, "requirements/sglang-runtime.txt"), encoding="utf-8") as f:
        head = f.readline()
    assert f"sglang=={TESTED_SGLANG}" in head, head
    runtime = pins(requirement_files["requirements/sglang-runtime.txt"])
    for dep, spec in DECLARED[("sglang", TESTED_SGLANG)].items():
        if dep != "torch":
            assert runtime.get(dep) == spec.lstrip("="), f"sglang-runtime.txt pins {dep}=={runtime.get(dep)}"


def test_smoke_test_imports_every_compiled_piece(instructions, requirement_files):
    last = [a for kw, a in instructions if kw == "RUN"][-1]
    imports = set()
    for m in re.finditer(r"python -c \"([^\"]*)\"", last):
        for stmt in m.group(1).split(";"):
            if stmt.strip().startswith("import "):
                imports |= {x.strip() for x in stmt.strip()[len("import "):].split(",")}
    wanted = set(COMPILED_IMPORTS)
    if "apex" in _all_pins(requirement_files):
        wanted.add("apex")
    assert wanted <= imports, f"the smoke test does not import {sorted(wanted - imports)}"
    assert "hapo doctor --only env,imports --strict" in last
    assert "torch-version.txt" in last


def test_default_command_runs_a_real_config_with_its_ranks(instructions):
    import json

    from hapo_megatron.config import load_config
    cmd = json.loads([a for kw, a in instructions if kw == "CMD"][-1])  # exec form
    local = [os.path.join(ROOT, c.replace("/opt/hapo_megatron/", "", 1)) for c in cmd
             if c.startswith("/opt/hapo_megatron/")]
    launcher = next(p for p in local if p.endswith("launch.sh"))
    config = next(p for p in local if p.endswith(".yaml"))
    assert os.path.isfile(launcher) and os.path.isfile(config), cmd
    cfg = load_config(config, [])
    assert 8 % cfg.parallel.model_parallel_size == 0, "the default recipe must fit one 8-GPU node"
    text = open(launcher, encoding="utf-8").read()
    assert "nvidia-smi -L" in text and "--nproc-per-node" in text  # one rank per visible GPU
    assert not re.search(r"^\s*cd ", text, re.M), "the launcher must keep the caller's directory (mounted data/)"


def test_pins_satisfy_setup_cfg(requirement_files):
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    needed = [Requirement(line) for line in cfg["options"]["install_requires"].split("\n")
              if line.strip()]
    pinned = {}
    for reqs in requirement_files.values():
        pinned.update(pins(reqs))
    for req in needed:
        name = canonicalize_name(req.name)
        if name in TORCH_STACK:
            continue
        assert name in pinned, f"setup.cfg needs {req} but the image does not pin {name}"
        assert req.specifier.contains(pinned[name], prereleases=True), (
            f"image pins {name}=={pinned[name]}, setup.cfg requires {req}")


# ---------------------------------------------------------------------- registry (online)
def _fetch(name):
    url = f"https://pypi.org/pypi/{name}/json"
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.load(resp)


def _fetch_or_error(name):
    """The project's JSON, `None` for an unknown project (404), or the network error."""
    try:
        return _fetch(name)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        return e
    except (urllib.error.URLError, OSError, ValueError) as e:
        return e


def _pypi_reachable():
    try:
        _fetch("pip")
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _image_tags():
    platforms = [f"manylinux_2_{m}_x86_64" for m in range(39, 4, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64",
                  "linux_x86_64"]
    return set(cpython_tags(IMAGE_PYTHON, platforms=platforms)) | set(
        compatible_tags(IMAGE_PYTHON, platforms=platforms))


def _installable(files, tags):
    for f in files:
        if f.get("yanked"):
            continue
        name = f["filename"]
        if name.endswith((".tar.gz", ".zip")):
            return True
        if name.endswith(".whl") and set(parse_wheel_filename(name)[3]) & tags:
            return True
    return False


def test_pinned_versions_exist_on_pypi(requirement_files):
    if not _pypi_reachable():
        pytest.skip("PyPI (https://pypi.org/pypi/<name>/json) is unreachable: pinned versions "
                    "not checked against the registry (offline checks above still ran)")
    wanted = {}
    for reqs in requirement_files.values():
        wanted.update(pins(reqs))
    with ThreadPoolExecutor(max_workers=8) as pool:
        projects = dict(zip(wanted, pool.map(_fetch_or_error, wanted)))
    errors = {n: p for n, p in projects.items() if isinstance(p, Exception)}
    if errors:  # a transient network failure is not a wrong pin
        pytest.skip(f"PyPI lookups failed for {sorted(errors)}: {next(iter(errors.values()))}")
    tags = _image_tags()
    problems = [f"{n}: no such project on PyPI" for n, p in sorted(projects.items()) if p is None]
    for name, version in sorted(wanted.items()):
        if projects[name] is None:
            continue
        # `==1.4` matches 1.4.0 (PEP 440 zero padding): compare parsed versions
        files = next((f for v, f in projects[name]["releases"].items()
                      if Version(v) == Version(version)), None)
        if files is None:
            problems.append(f"{name}=={version}: no such release")
        elif not files or all(f.get("yanked") for f in files):
            problems.append(f"{name}=={version}: yanked or without files")
        elif not _installable(files, tags):
            problems.append(f"{name}=={version}: no sdist or wheel for Python "
                            f"{IMAGE_PYTHON[0]}.{IMAGE_PYTHON[1]} on Linux x86_64")
    assert not problems, "\n".join(problems)


def _declared_spec(requires_dist, dep: str):
    """The specifier of ``dep`` in a Requires-Dist list (extras' entries included), or None."""
    for line in requires_dist or []:
        r = Requirement(line)
        if canonicalize_name(r.name) == dep:
            return r.specifier
    return None


def _requires_dist(name: str, version: str):
    """Requires-Dist of name==version from PyPI's JSON API (the per-version page, else the
    project page when its newest version is that one); None when neither has it."""
    for url in (f"https://pypi.org/pypi/{name}/{version}/json", f"https://pypi.org/pypi/{name}/json"):
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                info = json.load(resp)["info"]
        except (urllib.error.URLError, OSError, ValueError):
            continue
        if Version(info["version"]) == Version(version):
            return info.get("requires_dist") or []
    return None


def test_declared_requirements_match_pypi_metadata():
    if not _pypi_reachable():
        pytest.skip("PyPI (https://pypi.org/pypi/<name>/json) is unreachable: DECLARED not re-read")
    problems, unread = [], []
    for (name, version), needs in DECLARED.items():
        requires = _requires_dist(name, version)
        if requires is None:
            unread.append(f"{name}=={version}")
            continue
        for dep, spec in needs.items():
            got = _declared_spec(requires, dep)
            if got is None or got != SpecifierSet(spec):
                problems.append(f"{name}=={version} declares {dep}{got}, DECLARED records {dep}{spec}")
    assert not problems, "\n".join(problems)
    if len(unread) == len(DECLARED):
        pytest.skip(f"PyPI's JSON API gave no metadata for {unread}")


# ------------------------------------------------------- the steps, replayed by pip's resolver
# sglang 0.5.23 declares these, left out of the image on purpose (docs/docker.md): built for
# another torch (torchaudio 2.11), video decoding (torchcodec).
LEFT_OUT = {"sglang": {"torchaudio", "torchcodec"}}


def test_replay_reads_the_dockerfile_steps(instructions):
    from tests.docker_resolve import freeze_pattern, image_pip_version, pip_steps
    steps = pip_steps(instructions)
    files = [[a for i, a in enumerate(args) if i and args[i - 1] == "-r"] for args, _ in steps]
    assert files[1:5] == [["requirements/torch.txt"], ["requirements/te.txt"], ["requirements/sglang.txt"],
                          ["requirements/base.txt", "requirements/sglang-runtime.txt"]], files
    # our pins and SGLang's runtime pins in ONE resolution: no later step swaps what base.txt chose
    assert [c for _, c in steps][1:] == [False, True, True, True, True]  # keep-torch.txt from step 2 on
    keep = freeze_pattern(instructions)
    for frozen in ("torch==2.14.1", "cuda-bindings==13.4.4", "cuda-python==13.4.4", "nvidia-nccl-cu13==2.30.7"):
        assert keep.match(frozen), frozen
    assert not keep.match("numpy==2.4.6")
    assert image_pip_version(instructions) == "25.3"


def test_no_router_in_the_image(requirement_files):
    names = {canonicalize_name(r.name) for reqs in requirement_files.values() for r in reqs}
    assert "sglang-router" not in names  # rollout.sglang.use_router is refused at start


def test_consistency_check_catches_an_unmet_requirement():
    from tests.docker_resolve import unmet_requirements
    installed = {"cuda-python": "13.4.4", "cuda-bindings": "13.5.0", "sglang": "0.5.23"}
    requires = {"cuda-python": ["cuda-bindings~=13.4.4"], "cuda-bindings": ['pywin32; sys_platform == "win32"'],
                "sglang": ["torchaudio==2.11.0", 'decord; platform_machine == "aarch64"']}
    assert unmet_requirements(installed, requires, LEFT_OUT) == [
        "cuda-python==13.4.4 requires cuda-bindings~=13.4.4, the image has cuda-bindings==13.5.0"]
    assert len(unmet_requirements(installed, requires, {})) == 2  # torchaudio, when not left out


@pytest.fixture(scope="module")
def replayed(instructions, tmp_path_factory):
    """The Dockerfile's pip steps resolved by the image's pip (tests/docker_resolve.py); several
    minutes on a busy 2-core machine (every distribution's metadata by HTTP range requests)."""
    from tests.docker_resolve import PipUnavailable, replay
    try:
        installed, requires, timings = replay(instructions, ROOT, str(tmp_path_factory.mktemp("docker-resolve")))
    except PipUnavailable as e:
        pytest.skip(f"pip's resolver could not reach the package index: {e}")
    for args, seconds in timings:
        print(f"pip install --dry-run {args}: {seconds:.0f} s")
    return installed, requires


@pytest.mark.slow
def test_image_steps_resolve_with_pip(replayed):
    installed, _ = replayed
    assert installed["torch"] == "2.14.1" and installed["sglang"] == TESTED_SGLANG
    assert installed["transformer-engine"] == "2.11.0" and installed["transformer-engine-torch"] == "2.11.0"
    runtime = pins(read_requirements("requirements/sglang-runtime.txt"))
    for name, version in {**pins(read_requirements("requirements/base.txt")), **runtime}.items():
        assert Version(installed[name]) == Version(version), f"{name}: {installed[name]} installed, {version} pinned"


@pytest.mark.slow
def test_image_meets_every_declared_requirement(replayed):
    from tests.docker_resolve import unmet_requirements
    installed, requires = replayed
    assert unmet_requirements(installed, requires, LEFT_OUT) == []
