import os
import sys

import pytest
import torch

# Tests import `tests.distributed`; make the repository root importable when pytest runs from it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# wandb (offline in every test) records telemetry for an online default before a run's mode is
# read, and exports it to its cloud from a background thread minutes later: off for the tests
# and the processes they start, which inherit the environment
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("OTEL_SDK_DISABLED", "true")

# No test reaches the network: the guard's hooks, for this process and its child Pythons
# (tests/no_network/plugin.py, docs/testing.md "No network in the tests").
from tests.no_network.plugin import (  # noqa: E402,F401 - pytest finds the hooks by name here
    pytest_configure,
    pytest_runtest_makereport,
    pytest_unconfigure,
)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
