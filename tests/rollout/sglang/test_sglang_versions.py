"""One SGLang version pin: requirements/sglang.txt, setup.cfg's `sglang` extra, the README's and
CI's install commands and (when installed) the SGLang the real-server tests run against agree."""

import configparser
import importlib.metadata
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _read(rel):
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def test_one_sglang_pin_everywhere():
    (pinned,) = re.findall(r"^sglang==(\S+)$", _read("requirements/sglang.txt"), flags=re.M)
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    extra = [x.strip() for x in cfg["options.extras_require"]["sglang"].splitlines() if x.strip().startswith("sglang")]
    assert extra == [f"sglang=={pinned}"]
    readme = _read("README.md")
    assert "pip install --no-deps -r requirements/sglang.txt" in readme and f"sglang=={pinned}" in readme
    ci = _read(".ci/run")
    assert "-r requirements/sglang.txt" in ci and "-r requirements/sglang-cpu.txt" in ci
    assert "sglang==" not in ci.replace("requirements/sglang.txt", "")  # no second pin
    try:
        installed = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return
    assert installed == pinned, f"installed sglang {installed} is not the pinned, tested {pinned}"


def test_readme_test_command_is_what_ci_runs():
    readme = _read("README.md")
    (cmd,) = [line for line in readme.splitlines() if line.startswith("pip install torch==") and "pytest" in line]
    ci = [re.sub(r"\s+#.*$", "", line).replace("python -m pip", "pip").strip()
          for line in _read(".ci/run").splitlines() if line.startswith("python -m p")]
    assert " && ".join(ci) == cmd
