"""The session's pool of real SGLang servers (docs/testing.md "The suite's time"): a server starts
on first use (20-45 s on a 2-core CPU machine) and is shared by every later test that asks for
it; one that a test killed is started again only when a later test asks for it."""

import os
import signal

import pytest

from hapo_megatron.rollout.api_key import new_api_key
from hapo_megatron.rollout.sglang_launch import stop_process

from .real_sglang import require_sglang, start_server, tiny_model_dir


class RealServerPool:
    """Servers on the tiny model requiring one API key, by slot (0, 1, ...)."""

    def __init__(self, model_dir: str, api_key: str, log_dir: str, start=start_server):
        self.model_dir, self.api_key, self.log_dir, self._start = model_dir, api_key, log_dir, start
        self.handles, self.starts = {}, 0

    def get(self, slot: int = 0):
        """The running server of ``slot``, started (again) when it has none or its process exited."""
        handle = self.handles.get(slot)
        if handle is not None and handle.exit_code() is None:
            return handle
        if handle is not None:  # a test killed it: end what is left of its process group
            try:
                os.killpg(handle.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.starts += 1
        log = os.path.join(self.log_dir, f"server{slot}.start{self.starts}.log")
        self.handles[slot] = self._start(self.model_dir, log, self.api_key)
        return self.handles[slot]

    def close(self) -> None:
        for handle in self.handles.values():
            stop_process(handle)
        self.handles.clear()


@pytest.fixture(scope="session")
def real_model_dir(tmp_path_factory):
    require_sglang()
    return tiny_model_dir(str(tmp_path_factory.mktemp("sglang_tiny")))


@pytest.fixture(scope="session")
def real_api_key():
    """The real server's API key: every test request to it carries this key."""
    return new_api_key()


@pytest.fixture(scope="session")
def real_server_pool(real_model_dir, real_api_key, tmp_path_factory):
    pool = RealServerPool(real_model_dir, real_api_key, str(tmp_path_factory.mktemp("sglang_logs")))
    yield pool
    pool.close()


@pytest.fixture
def real_server(real_server_pool):
    """A running SGLang server on the tiny model, requiring ``real_api_key`` (the pool's slot 0,
    shared by the session; a test may kill it); tests push the weights they need first."""
    return real_server_pool.get(0)
