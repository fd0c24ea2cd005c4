"""The network guard itself (tests/no_network/, docs/testing.md "No network in the tests"): a
non-loopback connection or name lookup fails with a clear message, in this process and in a child
Python, and a test that swallows the error still fails; loopback and Unix sockets work."""

import errno
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from tests.no_network import sitecustomize as guard
from tests.no_network.plugin import GUARD_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REMOTE = ("192.0.2.1", 9)  # TEST-NET-1 (RFC 5737): never routed


@pytest.fixture
def unlogged(monkeypatch):
    """Attempts made by the test itself are expected: keep them out of the session's log."""
    monkeypatch.delenv(guard.LOG_ENV)


@pytest.mark.parametrize("how", ["connect", "connect_ex", "create_connection", "getaddrinfo"])
def test_non_loopback_access_is_blocked_with_a_clear_message(unlogged, how):
    with pytest.raises(guard.NetworkAccessBlocked, match=r"network access blocked in the tests.*127\.0\.0\.1"):
        if how == "create_connection":
            socket.create_connection(REMOTE, timeout=1)
        elif how == "getaddrinfo":
            socket.getaddrinfo("pypi.org", 443)
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                getattr(s, how)(REMOTE)


def test_a_udp_route_lookup_is_allowed_but_sending_on_it_is_not(unlogged):
    from hapo_megatron.rollout.sglang.launch import node_ip
    assert node_ip() != ""  # connects a UDP socket to 10.255.255.255 to read the route: no packet
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(REMOTE)  # the guard lets the route lookup through
        except OSError as e:  # a machine without a default route refuses it itself (not the guard)
            assert not isinstance(e, guard.NetworkAccessBlocked) and e.errno in (errno.ENETUNREACH,
                                                                                 errno.EHOSTUNREACH), e
        with pytest.raises(guard.NetworkAccessBlocked, match=r"send to \('192.0.2.1', 9\)"):
            s.send(b"x")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        with pytest.raises(guard.NetworkAccessBlocked, match="send to"):
            s.sendto(b"x", REMOTE)
        s.sendto(b"x", ("127.0.0.1", 9))  # loopback: allowed


@pytest.mark.parametrize("host", ["8.8.8.8", "::ffff:10.0.0.1", "2001:db8::1", "example.org", b"pypi.org"])
def test_remote_hosts_are_not_loopback(host):
    assert not guard.is_loopback_host(host)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.3", "::1", "localhost", "::ffff:127.0.0.1", "0.0.0.0",
                                  b"localhost", "[::1]", None])
def test_loopback_hosts_are_allowed(host):
    assert guard.is_loopback_host(host)


def test_loopback_tcp_and_unix_sockets_work(tmp_path):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(("localhost", server.getsockname()[1]), timeout=5):
            pass
    path = str(tmp_path / "s")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        server.listen(1)
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(path)


def _child_env(log):
    env = dict(os.environ)
    env[guard.LOG_ENV] = str(log)
    return env


def test_child_pythons_load_the_guard(tmp_path):
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == GUARD_DIR
    log = tmp_path / "blocked.log"
    code = "import socket; socket.create_connection(('192.0.2.1', 9), timeout=1)"
    proc = subprocess.run([sys.executable, "-c", code], env=_child_env(log), capture_output=True, text=True)
    assert proc.returncode != 0 and "NetworkAccessBlocked" in proc.stderr, proc.stderr
    assert "name lookup of '192.0.2.1'" in log.read_text()  # create_connection checks the name first


def test_a_cpu_sglang_servers_environment_keeps_the_guard(tmp_path):
    """The CPU server's stand-ins put their own sitecustomize first; it runs the guard's after it."""
    from hapo_megatron.rollout.sglang.launch import server_env
    log = tmp_path / "blocked.log"
    env = server_env(cpu=True, base=_child_env(log))
    code = "import socket; socket.getaddrinfo('pypi.org', 443)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "NetworkAccessBlocked" in proc.stderr, proc.stderr
    assert "pypi.org" in log.read_text()


def test_a_test_that_swallows_the_error_still_fails(tmp_path):
    (tmp_path / "conftest.py").write_text(
        "from tests.no_network.plugin import pytest_configure, pytest_runtest_makereport, pytest_unconfigure\n")
    (tmp_path / "test_swallow.py").write_text(textwrap.dedent("""
        import socket, subprocess, sys

        def test_swallowed():
            try:
                socket.create_connection(("192.0.2.1", 9), timeout=1)
            except Exception:
                pass

        def test_in_a_child():
            subprocess.run([sys.executable, "-c", "import socket; socket.getaddrinfo('pypi.org', 443)"])

        def test_loopback_only():
            socket.getaddrinfo("localhost", 80)
    """))
    env = {k: v for k, v in os.environ.items() if k != guard.LOG_ENV}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    out = proc.stdout
    assert "2 failed, 1 passed" in out, out
    assert "FAILED test_swallow.py::test_swallowed" in out and "FAILED test_swallow.py::test_in_a_child" in out
    assert "the test reached the network" in out and "pypi.org" in out
