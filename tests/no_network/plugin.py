"""Pytest side of the network guard (docs/testing.md "No network in the tests").

``pytest_configure`` installs the guard of ``sitecustomize.py`` in the pytest process before any
test is collected, names a log file for blocked attempts (``HAPO_TEST_NETWORK_LOG``) and puts this
directory first on ``PYTHONPATH``, so every child Python that inherits the environment loads the
guard too. After each phase of each test (setup, call, teardown) the attempts logged since the
previous phase, by this process or any child, turn that phase's report into a failure naming
them: a test fails even when the code under test swallowed :class:`NetworkAccessBlocked`.

Limit: a child started with an environment that drops ``PYTHONPATH`` (or a non-Python child)
is not guarded.
"""

import os
import tempfile

import pytest

from tests.no_network import sitecustomize as guard

GUARD_DIR = os.path.dirname(os.path.abspath(guard.__file__))


class _BlockedLog:
    """The shared log file and how far this process has read it."""

    def __init__(self, path: str):
        self.path, self.offset = path, 0

    def new_lines(self) -> list:
        try:
            with open(self.path, encoding="utf-8") as f:
                f.seek(self.offset)
                text = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        return [line for line in text.splitlines() if line.strip()]


_log = None


def pytest_configure(config):
    global _log
    if _log is not None:
        return
    fd, path = tempfile.mkstemp(prefix="hapo-test-network-", suffix=".log")
    os.close(fd)
    _log = _BlockedLog(path)
    os.environ[guard.LOG_ENV] = path
    old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != GUARD_DIR]
    os.environ["PYTHONPATH"] = os.pathsep.join([GUARD_DIR, *old])
    guard.install()


def pytest_unconfigure(config):
    if _log is not None:
        try:
            os.unlink(_log.path)
        except OSError:
            pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    blocked = _log.new_lines() if _log is not None else []
    if blocked:
        report.outcome = "failed"
        report.longrepr = "\n".join(["the test reached the network:", *blocked])
