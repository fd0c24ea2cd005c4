"""Checks of the Dockerfile, the requirement files and the lock it installs (`docker build` cannot
run in CI). All offline (docs/testing.md "No network in the tests").

The Dockerfile parses (known instructions, only ARG before the first FROM, a CUDA devel base),
every COPY source exists, every requirement line is a valid PEP 508 requirement, the torch stack
comes only from requirements/torch.txt (+ Transformer Engine from te.txt, built against it) and is
then frozen by a constraints file ADDED to the base image's, the stack is coherent by the packages'
declared requirements (recorded below, checked against the lock's metadata), SGLang and the
package go in with --no-deps, the build's smoke test imports every compiled piece, the default
command runs a real config with one rank per GPU, and the pins satisfy setup.cfg.

The lock (requirements/lock/, docs/docker.md "The lock"): every pip step installs exactly one lock
file, in the lock command's order, with --require-hashes --no-deps; each lock was generated from
today's input files, pins each distribution once with hashes, meets every input requirement,
leaves the frozen torch stack to the torch step, and the locked set meets every declared
requirement of every locked distribution, extras included (tests/image_lock.py).
"""

import configparser
import os
import re
import shlex

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from tests import image_lock

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
# Declared requirements of the pinned packages (their Requires-Dist, extras' included). Checked
# against requirements/lock/metadata.json, which the lock command reads from the locked files.
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
    """Requirement files referenced with `-r` in RUN lines (the lock files)."""
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
def lock():
    """tools/lock_requirements.py (its STEPS, digest and lock parser)."""
    return image_lock.lock_tool()


@pytest.fixture(scope="module")
def requirement_files(lock):
    """The input files of the lock: what the image is made of."""
    files = [f for _, step_files, _ in lock.STEPS for f in step_files]
    assert files, "the lock has no input file"
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
    for path in ("requirements/base.txt", "requirements/sglang.txt", "requirements/bootstrap.txt", *TORCH_FILES):
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
    if not any("pip list --format=freeze" in r and "keep-torch.txt" in r and "requirements/lock/torch.txt" in r
               for r in runs):
        problems.append("the torch constraints file is not generated right after installing the torch lock")
    if not any("--no-build-isolation --require-hashes --no-deps -r requirements/lock/te.txt" in r for r in runs):
        problems.append("Transformer Engine is not built against the installed torch (--no-build-isolation)")
    if not any(re.search(r"pip install --require-hashes --no-deps -r requirements/lock/sglang\.txt", r) for r in runs):
        problems.append("sglang is not installed with --no-deps")
    for run in runs:
        for words in shell_commands(run):
            while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value before the command
                words = words[1:]
            if words[:2] != ["pip", "install"] or words[2:] == ["--no-deps", "-e", "."]:
                continue
            files = [w for i, w in enumerate(words) if i and words[i - 1] == "-r"]
            if not ({"--require-hashes", "--no-deps"} <= set(words) and len(files) == 1
                    and files[0].startswith("requirements/lock/") and len(words) == 6 + (
                        "--no-build-isolation" in words)):
                problems.append(f"installs something else than one lock file with --require-hashes "
                                f"--no-deps: {' '.join(words)}")
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



# ------------------------------------------------------------------ the lock (requirements/lock/)
# sglang 0.5.23 declares these, left out of the image on purpose (docs/docker.md): built for
# another torch (torchaudio 2.11), video decoding (torchcodec).
LEFT_OUT = {"sglang": {"torchaudio", "torchcodec"}}


def pip_steps(instructions):
    """[(argv after `pip install`, constrained)] for every pip install of the RUN lines in order,
    `constrained` telling whether the keep-torch constraints file is active at that step."""
    steps, constrained = [], False
    for kw, arg in instructions:
        if kw == "ENV" and re.search(r"PIP_CONSTRAINT=.*keep-torch\.txt", arg):
            constrained = True
        if kw != "RUN":
            continue
        for words in shell_commands(arg):
            while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value before the command
                words = words[1:]
            if words[:2] == ["pip", "install"]:
                steps.append((words[2:], constrained))
    return steps


def freeze_pattern(instructions) -> re.Pattern:
    """The `grep -iE '...'` that the torch step applies to `pip list --format=freeze`."""
    for kw, arg in instructions:
        m = re.search(r"pip list --format=freeze\s*\|\s*grep -iE '([^']+)'", arg) if kw == "RUN" else None
        if m:
            return re.compile(m.group(1), re.I)
    raise AssertionError("the Dockerfile writes no keep-torch constraints from `pip list --format=freeze`")


@pytest.fixture(scope="module")
def lock_texts(lock):
    return image_lock.read_locks(ROOT, lock)


@pytest.fixture(scope="module")
def metadata(lock):
    return image_lock.read_metadata(ROOT, lock)


def test_dockerfile_installs_the_locks_in_order(instructions, lock):
    steps = pip_steps(instructions)
    files = [[a for i, a in enumerate(args) if i and args[i - 1] == "-r"] for args, _ in steps]
    assert files[:-1] == [[f"{lock.LOCK_DIR}/{name}"] for name, _, _ in lock.STEPS], files
    assert steps[-1][0] == ["--no-deps", "-e", "."]
    # keep-torch.txt from the step after torch on: no later lock can replace the torch stack
    assert [c for _, c in steps] == [False, False, True, True, True, True]
    keep = freeze_pattern(instructions)
    for frozen in ("torch==2.14.1", "cuda-bindings==13.4.4", "cuda-python==13.4.4", "nvidia-nccl-cu13==2.30.7"):
        assert keep.match(frozen), frozen
    assert not keep.match("numpy==2.4.6")


def test_lock_is_generated_from_the_inputs_and_coherent(instructions, lock, lock_texts, requirement_files):
    digest = lock.inputs_digest(ROOT)
    assert image_lock.lock_problems(lock_texts, requirement_files, digest, freeze_pattern(instructions), lock) == []


def test_lock_check_catches_a_stale_or_incoherent_lock(instructions, lock, lock_texts, requirement_files,
                                                        tmp_path):
    freeze, digest = freeze_pattern(instructions), lock.inputs_digest(ROOT)

    def problems(texts=lock_texts, inputs=requirement_files, dig=digest):
        return image_lock.lock_problems(texts, inputs, dig, freeze, lock)

    # an input edited without a new lock
    for path in lock.input_files():
        os.makedirs(os.path.dirname(tmp_path / path), exist_ok=True)
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            (tmp_path / path).write_text(f.read())
    base = tmp_path / "requirements/base.txt"
    base.write_text(base.read_text() + "einops==0.8.2\n")
    assert any("not generated from today's inputs" in p for p in problems(dig=lock.inputs_digest(str(tmp_path))))
    # an input requirement the lock does not meet
    raised = {**requirement_files, "requirements/base.txt": [*requirement_files["requirements/base.txt"],
                                                             Requirement("numpy>=9")]}
    assert any("requires numpy>=9" in p for p in problems(inputs=raised))
    # a torch-stack package in a later step, a package locked twice, a pin without hashes
    torch_block = "\n".join(lock.parse_lock(lock_texts["torch.txt"])["triton"]["block"])
    twice = {**lock_texts, "image.txt": lock_texts["image.txt"] + torch_block + "\n"}
    assert any("image.txt installs triton" in p for p in problems(twice))
    assert any("triton is locked by torch.txt and again by image.txt" in p for p in problems(twice))
    unhashed = {**lock_texts, "sglang.txt": lock_texts["sglang.txt"].split(" \\")[0] + "\n"}
    assert any("sglang==0.5.23 has no --hash" in p for p in problems(unhashed))


def test_lock_meets_every_declared_requirement(lock, lock_texts, metadata, requirement_files):
    installed = image_lock.locked_versions(lock_texts, lock)
    dists = metadata["distributions"]
    assert metadata["inputs-sha256"] == lock.inputs_digest(ROOT)
    assert {n: d["version"] for n, d in dists.items()} == installed
    requires = {n: d["requires_dist"] for n, d in dists.items()}
    inputs = [r for reqs in requirement_files.values() for r in reqs]
    extras = image_lock.requested_extras(inputs, requires, image_lock.image_marker_env())
    assert extras["transformer-engine"] == {"core_cu13", "pytorch"}  # extras are followed
    assert image_lock.unmet_requirements(installed, requires, LEFT_OUT, extras) == []


def test_lock_pins_what_the_image_promises(lock_texts, lock, requirement_files):
    installed = image_lock.locked_versions(lock_texts, lock)
    assert installed["torch"] == "2.14.1" and installed["sglang"] == TESTED_SGLANG
    assert installed["transformer-engine"] == "2.11.0" and installed["transformer-engine-torch"] == "2.11.0"
    assert {installed[n] for n in ("pip", "setuptools", "wheel")} == {"25.3", "80.9.0", "0.45.1"}
    assert stack_problems(installed) == []


def _declared_spec(requires_dist, dep: str):
    """The specifier of ``dep`` in a Requires-Dist list (extras' entries included), or None."""
    for line in requires_dist or []:
        r = Requirement(line)
        if canonicalize_name(r.name) == dep:
            return r.specifier
    return None


def test_declared_requirements_match_the_locked_metadata(metadata):
    dists = metadata["distributions"]
    problems = []
    for (name, version), needs in DECLARED.items():
        assert dists[name]["version"] == version, f"{name}: DECLARED records {version}, locked {dists[name]}"
        for dep, spec in needs.items():
            got = _declared_spec(dists[name]["requires_dist"], dep)
            if got is None or got != SpecifierSet(spec):
                problems.append(f"{name}=={version} declares {dep}{got}, DECLARED records {dep}{spec}")
    assert not problems, "\n".join(problems)


def test_modelopt_goes_in_without_its_hf_extra(lock, lock_texts, metadata, requirement_files):
    """No nvidia-modelopt release's `hf` extra admits the image's transformers (0.47.0, the newest,
    declares transformers<5.15; SGLang 0.5.23 pins 5.19.0): the image installs modelopt without it
    (docs/docker.md). The check would catch the extra being asked for."""
    (req,) = [r for r in requirement_files["requirements/base.txt"] if r.name == "nvidia-modelopt"]
    assert not req.extras
    installed = image_lock.locked_versions(lock_texts, lock)
    requires = {n: d["requires_dist"] for n, d in metadata["distributions"].items()}
    with_hf = image_lock.unmet_requirements(installed, requires, LEFT_OUT, {"nvidia-modelopt": {"hf"}})
    assert any(p.startswith("nvidia-modelopt==0.47.0 requires transformers<5.15") and "transformers==5.19.0" in p
               for p in with_hf), with_hf


def test_no_router_in_the_image(requirement_files):
    names = {canonicalize_name(r.name) for reqs in requirement_files.values() for r in reqs}
    assert "sglang-router" not in names  # the engine spreads requests itself (docs/multinode.md)


def test_consistency_check_catches_an_unmet_requirement():
    installed = {"cuda-python": "13.4.4", "cuda-bindings": "13.5.0", "sglang": "0.5.23", "x": "1"}
    requires = {"cuda-python": ["cuda-bindings~=13.4.4"], "cuda-bindings": ['pywin32; sys_platform == "win32"'],
                "sglang": ["torchaudio==2.11.0", 'decord; platform_machine == "aarch64"'],
                "x": ['cuda-bindings==13.4.4; extra == "cu"']}
    assert image_lock.unmet_requirements(installed, requires, LEFT_OUT) == [
        "cuda-python==13.4.4 requires cuda-bindings~=13.4.4, the image has cuda-bindings==13.5.0"]
    assert len(image_lock.unmet_requirements(installed, requires, {})) == 2  # torchaudio, when not left out
    # an extra's requirement counts once the extra is asked for, also through another package
    asked = image_lock.requested_extras([Requirement("y")], {**requires, "y": ["x[cu]"]},
                                        image_lock.image_marker_env())
    assert asked["x"] == {"cu"}
    assert len(image_lock.unmet_requirements(installed, requires, LEFT_OUT, asked)) == 2
