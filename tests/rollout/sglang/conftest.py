"""The session's pool of real SGLang servers (docs/testing.md "The suite's time"): a server starts
on first use (20-45 s on an idle 2-core CPU machine, minutes on a loaded one) and is shared by
every later test that asks for it; one that a test killed is started again only when a later test
asks for it. When the session holds a test that needs a second server, that one is launched
together with the first, so that their start-ups overlap."""

import os
import signal

import pytest

from hapo_megatron.rollout.sglang.api_key import new_api_key
from hapo_megatron.rollout.sglang.launch import stop_process

from .real_sglang import launch_server_process, require_sglang, tiny_model_dir, wait_started

SECOND_SERVER_FIXTURE = "second_real_server"


class RealServerPool:
    """Servers on the tiny model requiring one API key, by slot (0, 1, ...)."""

    def __init__(self, model_dir: str, api_key: str, log_dir: str, launch=launch_server_process,
                 wait=wait_started):
        self.model_dir, self.api_key, self.log_dir = model_dir, api_key, log_dir
        self._launch_fn, self._wait_fn = launch, wait
        self.handles, self.ready, self.starts = {}, set(), 0

    def prestart(self, slot: int) -> None:
        """Launch the server of ``slot`` without waiting for it (unless it runs already)."""
        handle = self.handles.get(slot)
        if handle is None or handle.exit_code() is not None:
            self._launch(slot)

    def get(self, slot: int = 0):
        """The running server of ``slot``, started (again) when it has none or its process exited."""
        self.prestart(slot)
        if slot not in self.ready:
            self._wait_fn(self.handles[slot])
            self.ready.add(slot)
        return self.handles[slot]

    def _launch(self, slot: int) -> None:
        old = self.handles.pop(slot, None)
        if old is not None:  # a test killed it: end what is left of its process group
            try:
                os.killpg(old.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.ready.discard(slot)
        self.starts += 1
        log = os.path.join(self.log_dir, f"server{slot}.start{self.starts}.log")
        self.handles[slot] = self._launch_fn(self.model_dir, log, self.api_key)

    def close(self) -> None:
        for handle in self.handles.values():
            stop_process(handle)
        self.handles.clear()
        self.ready.clear()


@pytest.fixture(scope="session")
def real_model_dir(tmp_path_factory):
    require_sglang()
    return tiny_model_dir(str(tmp_path_factory.mktemp("sglang_tiny")))


@pytest.fixture(scope="session")
def real_api_key():
    """The real server's API key: every test request to it carries this key."""
    return new_api_key()


@pytest.fixture(scope="session")
def real_server_pool(request, real_model_dir, real_api_key, tmp_path_factory):
    pool = RealServerPool(real_model_dir, real_api_key, str(tmp_path_factory.mktemp("sglang_logs")))
    if any(SECOND_SERVER_FIXTURE in getattr(item, "fixturenames", ()) for item in request.session.items):
        pool.prestart(1)
    yield pool
    pool.close()


@pytest.fixture
def real_server(real_server_pool):
    """A running SGLang server on the tiny model, requiring ``real_api_key`` (the pool's slot 0,
    shared by the session; a test may kill it); tests push the weights they need first."""
    return real_server_pool.get(0)


@pytest.fixture
def second_real_server(real_server_pool):
    """Another running server like ``real_server`` (the pool's slot 1)."""
    return real_server_pool.get(1)
