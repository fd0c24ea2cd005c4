"""The test suite's network guard (docs/testing.md "No network in the tests").

Every Python process of a test run loads it: pytest itself (``tests/conftest.py`` installs it) and
every child Python that inherits the suite's ``PYTHONPATH`` (this directory is prepended to it, so
Python imports this file as ``sitecustomize`` at start-up). It patches ``socket`` so that a
connection to anything but the loopback interface (127.0.0.0/8, ::1, ``localhost``) or a Unix
socket raises :class:`NetworkAccessBlocked`, and a name lookup of any other host name does too. A
UDP ``connect`` sends nothing (it only picks a route, as ``sglang_launch.node_ip`` does): it is
allowed, and sending on such a socket, or ``sendto`` a remote address, is blocked.
Every blocked attempt is appended to the file named by ``HAPO_TEST_NETWORK_LOG``, so that the
test that caused it fails even when the code under test swallowed the exception (or it happened
in a child process).

Self-contained on purpose: a child Python may not have the repository on its path.
"""

import ipaddress
import os
import socket
import weakref

LOG_ENV = "HAPO_TEST_NETWORK_LOG"
# UDP sockets connected to a remote address -> that address: may not send. Kept apart from the
# socket's peer: on a machine without a route the connect itself fails (ENETUNREACH), and a send
# on that socket must still be refused naming the address.
_routed_only = weakref.WeakKeyDictionary()
_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback", ""}


class NetworkAccessBlocked(RuntimeError):
    """A test opened (or looked up) a non-loopback address. Not an OSError on purpose: code that
    retries or falls back on network errors must not turn this into a silent skip."""


def is_loopback_host(host) -> bool:
    """Whether ``host`` (a name or a numeric address, str or bytes) stays on this machine."""
    if host is None:
        return True
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    host = str(host).strip("[]").split("%", 1)[0].lower()
    if host in _LOCAL_NAMES or host.endswith(".localhost"):
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    if getattr(addr, "ipv4_mapped", None) is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback or addr.is_unspecified  # 0.0.0.0 / :: connect to this machine


def _record(what: str) -> str:
    msg = (f"network access blocked in the tests (pid {os.getpid()}): {what}; tests may only reach "
           "127.0.0.1 / ::1 / localhost or Unix sockets (docs/testing.md)")
    path = os.environ.get(LOG_ENV)
    if path:
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(msg.replace("\n", " ") + "\n")
        except OSError:
            pass
    return msg


def _remote(family, address) -> bool:
    if family == getattr(socket, "AF_UNIX", None) or not isinstance(address, tuple) or not address:
        return False
    return not is_loopback_host(address[0])


def _check_address(sock, address) -> None:
    if not _remote(sock.family, address):
        return
    if sock.type == socket.SOCK_DGRAM:  # a UDP connect sends nothing (it picks the route: node_ip);
        _routed_only[sock] = address    # what is sent on it is checked
        return
    raise NetworkAccessBlocked(_record(f"connect to {address!r}"))


def _check_send(sock, address=None) -> None:
    if sock in _routed_only or (address is not None and _remote(sock.family, address)):
        raise NetworkAccessBlocked(_record(f"send to {address or _routed_only[sock]!r}"))


def _check_name(host) -> None:
    if is_loopback_host(host) or _is_own_hostname(host):
        return
    raise NetworkAccessBlocked(_record(f"name lookup of {host!r}"))


def _is_own_hostname(host) -> bool:
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    return isinstance(host, str) and host.lower() == socket.gethostname().lower()


def install() -> None:
    """Patch ``socket`` in this process (idempotent)."""
    if getattr(socket, "_hapo_network_guard", False):
        return
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_send, real_sendto = socket.socket.send, socket.socket.sendto
    real_getaddrinfo, real_create_connection = socket.getaddrinfo, socket.create_connection

    def connect(self, address):
        _check_address(self, address)
        return real_connect(self, address)

    def connect_ex(self, address):
        _check_address(self, address)
        return real_connect_ex(self, address)

    def send(self, data, *args):
        _check_send(self)
        return real_send(self, data, *args)

    def sendto(self, data, *args):
        _check_send(self, args[-1])
        return real_sendto(self, data, *args)

    def getaddrinfo(host, *args, **kwargs):
        _check_name(host)
        return real_getaddrinfo(host, *args, **kwargs)

    def create_connection(address, *args, **kwargs):
        _check_name(address[0])
        return real_create_connection(address, *args, **kwargs)

    socket.socket.connect, socket.socket.connect_ex = connect, connect_ex
    socket.socket.send, socket.socket.sendto = send, sendto
    socket.getaddrinfo, socket.create_connection = getaddrinfo, create_connection
    socket._hapo_network_guard = True


if os.environ.get(LOG_ENV):
    install()
