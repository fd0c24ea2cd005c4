"""A small HTTP client for SGLang servers: JSON POST/GET with timeouts, retries with exponential
backoff, health checks, and a clear error when a server process dies.

The transport is injectable (``session=``: anything with ``requests.Session``'s ``post`` / ``get``)
so the tests drive every path with a fake, without a server.

Connection pool: requests keeps 10 connections per host by default, while a rollout has hundreds
of ``/generate`` calls in flight (the partial and asynchronous loops: one per group). Every call
past the pool's size opened a fresh connection and dropped it when done ("Connection pool is
full, discarding connection"). On a ``requests.Session`` the client sizes the pool from the calls
in flight: the first call past the size mounts a pool of twice the size (at least the calls in
flight), for as many hosts as it talks to (docs/multinode.md, "Network settings worth knowing").
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from hapo_megatron.rollout.sglang.api_key import auth_headers

try:  # installed with SGLang (its servers write their answers with it); the stdlib reads them otherwise
    import orjson as _orjson
except ImportError:  # pragma: no cover - an install without SGLang's dependencies
    _orjson = None


class SGLangError(RuntimeError):
    """A request to an SGLang server failed (after retries, or with a non-retryable answer)."""


class ServerDiedError(SGLangError):
    """An SGLang server process exited or stopped answering health checks."""


class EndpointNotFoundError(SGLangError):
    """The server answered 404: it has no such endpoint (an older or newer SGLang version)."""


class RequestRefusedError(SGLangError):
    """The server answered a non-retryable 4xx: the request (or its API key) is wrong, the
    server is fine."""


class ServerUnreachableError(SGLangError):
    """No answer from the server: connection refused or reset, or no answer within the timeout."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def _is_requests_session(session: Any) -> bool:
    try:
        import requests
    except ImportError:  # pragma: no cover
        return False
    return isinstance(session, requests.Session)


def _log_tail(path: Optional[str], n_chars: int = 3000) -> str:
    if not path:
        return ""
    try:
        with open(path, "r", errors="replace") as f:
            data = f.read()
        return f"\n--- last lines of {path} ---\n{data[-n_chars:]}"
    except OSError:
        return ""


@dataclass
class ServerHandle:
    """One SGLang server: its URL and, when we launched it, its process and log file."""

    url: str
    process: Any = None  # subprocess.Popen when launched by us
    log_path: Optional[str] = None
    tp_size: int = 1
    log_copier: Any = None  # the thread writing the process's output to log_path, if any
    launch: Any = None  # how the process was started (sglang_launch.LaunchSpec): what a restart repeats

    def exit_code(self) -> Optional[int]:
        """The process's exit code when it has exited, else ``None`` (also for attached servers)."""
        return None if self.process is None else self.process.poll()

    def died_error(self, what: str) -> ServerDiedError:
        code = self.exit_code()
        if code is not None and self.log_copier is not None:
            self.log_copier.join(timeout=5.0)  # its last lines are the ones that explain the exit
            self.log_copier = None  # waited once
        status = f"exited with code {code}" if code is not None else "is not answering"
        return ServerDiedError(f"SGLang server {self.url} {status} during {what}{_log_tail(self.log_path)}")


RETRYABLE_STATUS = (408, 429, 500, 502, 503, 504)
AUTH_HINT = ("the server wants an API key this client does not have: set $HAPO_ROLLOUT_API_KEY to the key its "
             "--api-key/--admin-api-key got, or keep the run's rollout_api_key file (README, Security)")


DEFAULT_POOL_SIZE = 10  # requests' own default (HTTPAdapter pool_connections and pool_maxsize)


class _PoolSizer:
    """Counts the calls in flight on a ``requests.Session`` and keeps its HTTP(S) adapters' pools
    at least that large per host, and holding a pool for each host the calls went to.

    A replaced adapter is closed only once no call that entered before its replacement is still
    in flight: such a call may already hold one of its pools, and urllib3 answers a closed pool
    with ``ClosedPoolError`` (a failed call that never reached the server). Each mount starts a
    generation; a call counts in the generation it entered, and can only use adapters of that
    generation or later, so the adapter retired at generation g closes once the calls of
    generations <= g have all left."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.maxsize = DEFAULT_POOL_SIZE
        self.hosts: set[str] = set()
        self.in_flight = 0
        self.generation = 0
        self._calls_by_generation: dict[int, int] = {}
        self._retired: list[tuple[int, Any]] = []  # (the generation that replaced it, adapter)
        self._lock = threading.Lock()

    def enter(self, url: str) -> int:
        """Counts one call to ``url`` in flight; returns its generation (for :meth:`leave`)."""
        with self._lock:
            self.in_flight += 1
            host = url.split("/", 3)[2] if "://" in url else url
            new_host = host not in self.hosts
            self.hosts.add(host)
            grow = self.in_flight > self.maxsize
            if grow:
                self.maxsize = max(self.in_flight, 2 * self.maxsize)
            if grow or (new_host and len(self.hosts) > DEFAULT_POOL_SIZE):
                self._mount()
            self._calls_by_generation[self.generation] = self._calls_by_generation.get(self.generation, 0) + 1
            return self.generation

    def leave(self, generation: int) -> None:
        with self._lock:
            self.in_flight -= 1
            left = self._calls_by_generation[generation] - 1
            if left:
                self._calls_by_generation[generation] = left
            else:
                del self._calls_by_generation[generation]
            oldest_in_flight = min(self._calls_by_generation, default=self.generation)
            # an adapter replaced by generation g served the calls of generations < g
            drained = [adapter for replaced_by, adapter in self._retired if replaced_by <= oldest_in_flight]
            self._retired = [(g, a) for g, a in self._retired if g > oldest_in_flight]
        for adapter in drained:
            adapter.close()

    def _mount(self) -> None:
        from requests.adapters import HTTPAdapter

        self.generation += 1
        for prefix in ("http://", "https://"):
            old = self.session.adapters.get(prefix)
            self.session.mount(prefix, HTTPAdapter(pool_connections=max(DEFAULT_POOL_SIZE, len(self.hosts)),
                                                   pool_maxsize=self.maxsize))
            if old is not None:  # closed once the calls that may hold its pools have left (docstring)
                self._retired.append((self.generation, old))


_gc_lock = threading.Lock()
_gc_pauses = [0, False]  # blocks inside `gc_paused`, and whether the collector was on before the first
# decodes that overlap back to back (hundreds of calls in flight) could keep the collector off for
# good: a block that leaves while others are inside runs a young-generation pass at most this often
GC_YOUNG_PASS_EVERY_S = 1.0
_gc_last_pass = [time.monotonic()]


@contextlib.contextmanager
def gc_paused():
    """The cyclic garbage collector off for the block: concurrent and nested blocks count, the last
    one out turns it back on (if it was on). Objects freed by reference counting go at once as
    always; only cycles made meanwhile wait for the next collection, or for the young-generation
    pass a block leaving while others are inside runs every ``GC_YOUNG_PASS_EVERY_S``."""
    with _gc_lock:
        if _gc_pauses[0] == 0:
            _gc_pauses[1] = gc.isenabled()
            gc.disable()
        _gc_pauses[0] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses[0] -= 1
            if _gc_pauses[0] == 0 and _gc_pauses[1]:
                gc.enable()
                _gc_last_pass[0] = time.monotonic()
            elif _gc_pauses[1] and time.monotonic() - _gc_last_pass[0] >= GC_YOUNG_PASS_EVERY_S:
                gc.collect(0)  # others still decode: the cycles made meanwhile still go, now and then
                _gc_last_pass[0] = time.monotonic()


class SGLangHTTP:
    """JSON-over-HTTP calls with retries.

    Args:
        timeout_s: per-request timeout (seconds).
        max_retries: extra attempts after the first for retryable failures (connection errors,
            timeouts, HTTP 408/429/5xx).
        backoff_s: first backoff; doubles each retry (capped at ``max_backoff_s``).
        session: transport with ``post(url, json=, timeout=)`` and ``get(url, timeout=)``
            returning objects with ``status_code``, ``json()``, ``text`` (default: ``requests``).
        sleep: injectable ``time.sleep`` (tests).
        api_key: sent with every request as ``Authorization: Bearer ...`` (``rollout/sglang/api_key.py``).
    """

    def __init__(self, *, timeout_s: float, max_retries: int, backoff_s: float = 1.0,
                 max_backoff_s: float = 30.0, session: Any = None,
                 sleep: Callable[[float], None] = time.sleep, api_key: Optional[str] = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if session is None:
            import requests

            session = requests.Session()
        self.session = session
        self._pool = _PoolSizer(session) if _is_requests_session(session) else None
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.sleep = sleep
        # passed only when there is a key, so a transport without ``headers=`` still works keyless
        self._auth = {"headers": auth_headers(api_key)} if api_key else {}

    @staticmethod
    def _is_timeout(e: BaseException) -> bool:
        try:
            import requests

            if isinstance(e, requests.Timeout):
                return True
        except ImportError:  # pragma: no cover
            pass
        return isinstance(e, TimeoutError)

    @staticmethod
    def _is_transport_error(e: BaseException) -> bool:
        try:
            import requests

            if isinstance(e, (requests.ConnectionError, requests.Timeout)):
                return True
        except ImportError:  # pragma: no cover
            pass
        return isinstance(e, (ConnectionError, TimeoutError, OSError))

    def request(self, server: ServerHandle, path: str, payload: Optional[dict] = None, *,
                method: str = "POST", retries: Optional[int] = None,
                timeout_s: Optional[float] = None, retry_timeouts: bool = True) -> Any:
        """Send one request; returns the decoded JSON body (``None`` for an empty body).

        Raises :class:`ServerDiedError` when the launched process has exited (checked before each
        attempt and after each failure), :class:`ServerUnreachableError` when the last attempt got
        no answer (with ``retry_timeouts=False`` at once after a timeout: a wedged server is
        found within one timeout, and the caller sends the request elsewhere),
        :class:`RequestRefusedError` on a non-retryable HTTP error (4xx)
        and :class:`SGLangError` after the last retry, with the server's message.
        """
        retries = self.max_retries if retries is None else int(retries)
        url = server.url.rstrip("/") + path
        last: str = ""
        unreachable: Optional[ServerUnreachableError] = None
        for attempt in range(retries + 1):
            if server.exit_code() is not None:
                raise server.died_error(f"{method} {path}")
            try:
                with self._in_flight(url):
                    if method == "GET":
                        resp = self.session.get(url, timeout=timeout_s or self.timeout_s, **self._auth)
                    else:
                        resp = self.session.post(url, json=payload, timeout=timeout_s or self.timeout_s,
                                                 **self._auth)
            except Exception as e:  # noqa: BLE001 - classified below
                if not self._is_transport_error(e):
                    raise
                timed_out = self._is_timeout(e)
                last = (f"no answer within {timeout_s or self.timeout_s:g} s" if timed_out else "no answer") + \
                    f" ({type(e).__name__}: {e})"
                unreachable = ServerUnreachableError(
                    f"SGLang server {server.url}: {method} {path}: {last}", timed_out=timed_out)
                if timed_out and not retry_timeouts and server.exit_code() is None:
                    raise unreachable
            else:
                unreachable = None
                if resp.status_code == 200:
                    return self._json(resp)
                last = f"HTTP {resp.status_code}: {getattr(resp, 'text', '')[:2000]}"
                if resp.status_code == 404:
                    raise EndpointNotFoundError(f"SGLang server {server.url} has no endpoint {method} {path}: {last}")
                if resp.status_code in (401, 403):
                    raise RequestRefusedError(
                        f"SGLang server {server.url} refused {method} {path}: {last} ({AUTH_HINT})")
                if resp.status_code not in RETRYABLE_STATUS:
                    raise RequestRefusedError(f"SGLang server {server.url} refused {method} {path}: {last}")
            if server.exit_code() is not None:
                raise server.died_error(f"{method} {path}")
            if attempt < retries:
                self.sleep(min(self.backoff_s * (2 ** attempt), self.max_backoff_s))
        if unreachable is not None:
            raise unreachable
        raise SGLangError(f"SGLang server {server.url}: {method} {path} failed after {retries + 1} attempt(s): {last}")

    @contextlib.contextmanager
    def _in_flight(self, url: str):
        """One call in flight on the session (the pool grows with them; docstring above)."""
        if self._pool is None:
            yield
            return
        generation = self._pool.enter(url)
        try:
            yield
        finally:
            self._pool.leave(generation)

    @staticmethod
    def _json(resp: Any) -> Any:
        """The answer's JSON (None for an empty body), the manager's largest host cost at recipe scale
        (a ``/generate`` answer holds a ``[logprob, id, null]`` list per token; tools/bench/README.md,
        host_step.py). Decoded with the cyclic garbage collector paused (`gc_paused`): a JSON tree has
        no cycles, and the collections its lists trigger tripled the stdlib's decode time (0.33 s
        against 0.10 s on a group of 16 answers of 10k tokens); a body of bytes
        through orjson, SGLang's own JSON library, where it is installed (3x the stdlib's speed);
        what orjson refuses (NaN / Infinity literals) the stdlib reads. orjson reads an integer past
        64 bits as a float: SGLang's answers hold none (token ids, counts, seeds < 2**63)."""
        content = getattr(resp, "content", None)
        with gc_paused():
            if _orjson is not None and isinstance(content, bytes):
                if not content.strip():
                    return None
                try:
                    return _orjson.loads(content)
                except _orjson.JSONDecodeError:
                    pass
            return SGLangHTTP._json_stdlib(resp)

    @staticmethod
    def _json_stdlib(resp: Any) -> Any:
        """`_json` through requests' own decoding (the stdlib's json; transports that hand no bytes)."""
        text = getattr(resp, "text", None)
        if text is not None and not str(text).strip():
            return None
        return resp.json()

    def healthy(self, server: ServerHandle, timeout_s: float = 5.0) -> bool:
        """One ``GET /health`` (True on HTTP 200); never raises for transport errors."""
        url = server.url.rstrip("/") + "/health"
        try:
            with self._in_flight(url):
                resp = self.session.get(url, timeout=timeout_s, **self._auth)
        except Exception as e:  # noqa: BLE001
            if self._is_transport_error(e):
                return False
            raise
        return resp.status_code == 200

    def wait_healthy(self, server: ServerHandle, timeout_s: float, *, poll_s: float = 0.5,
                     clock: Callable[[], float] = time.monotonic) -> None:
        """Poll ``/health`` until it answers 200; :class:`ServerDiedError` if the process exits
        first, :class:`SGLangError` after ``timeout_s``."""
        deadline = clock() + float(timeout_s)
        while True:
            if server.exit_code() is not None:
                raise server.died_error("start-up")
            if self.healthy(server):
                return
            if clock() >= deadline:
                raise SGLangError(f"SGLang server {server.url} not healthy after {timeout_s:.0f} s"
                                  f"{_log_tail(server.log_path)}")
            self.sleep(poll_s)

    def check_alive(self, server: ServerHandle) -> None:
        """Raise :class:`ServerDiedError` when the server's process exited or /health fails."""
        if server.exit_code() is not None or not self.healthy(server):
            raise server.died_error("health check")


__all__ = ["SGLangError", "ServerDiedError", "EndpointNotFoundError", "RequestRefusedError", "ServerUnreachableError",
           "ServerHandle", "SGLangHTTP", "RETRYABLE_STATUS"]
