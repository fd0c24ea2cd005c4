"""One real SGLang server shared by every test of the session that needs it (start-up costs
20-45 s on a 2-core CPU machine)."""

import pytest

from hapo_megatron.rollout.api_key import new_api_key
from hapo_megatron.rollout.sglang_launch import stop_process

from .real_sglang import require_sglang, start_server, tiny_model_dir


@pytest.fixture(scope="session")
def real_model_dir(tmp_path_factory):
    require_sglang()
    return tiny_model_dir(str(tmp_path_factory.mktemp("sglang_tiny")))


@pytest.fixture(scope="session")
def real_api_key():
    """The real server's API key: every test request to it carries this key."""
    return new_api_key()


@pytest.fixture(scope="session")
def real_server(real_model_dir, real_api_key, tmp_path_factory):
    """A running SGLang server on the tiny model, requiring ``real_api_key``; tests push the
    weights they need first."""
    handle = start_server(real_model_dir, str(tmp_path_factory.mktemp("sglang_logs") / "server.log"), real_api_key)
    yield handle
    stop_process(handle)
