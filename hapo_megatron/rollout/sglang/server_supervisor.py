"""Which rollout servers are in use, and the replacement of those that die (docs/multinode.md,
"Fault tolerance of the rollout servers").

A server is in one of three states:

- ``IN_USE``: it serves generation and takes every weight sync;
- ``RESTARTING``: it stopped answering and a new process was started exactly as the first
  (``sglang_launch.restart_process``: same command line, so the same GPUs, port and flags; same
  environment and API key). It serves nothing until it answers ``/health`` at a weight sync and
  has taken that whole sync: it never generates with stale weights;
- ``LOST``: it stopped answering and this process cannot restart it (an attached server, or
  another node's, which its node restarts). Like a restarting one it rejoins when it answers at a
  weight sync and has taken that sync.

:meth:`ServerSupervisor.request` sends a request to an in-use server and, when that server does
not answer (process gone, connection refused, no answer within the request timeout), marks it
unhealthy, restarts it and sends the same body (same per-row sampling seeds) to the next in-use
server. Past ``max_restarts`` restarts, or with no server left in use, it raises
:class:`ServerPoolError` (an ``SGLangError``: the trainer stops as for any failed engine).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Sequence

from hapo_megatron.rollout.sglang import launch as launcher
from hapo_megatron.rollout.sglang.client import (RequestRefusedError, ServerDiedError, ServerHandle,
                                                 ServerUnreachableError, SGLangError, SGLangHTTP)

IN_USE, RESTARTING, LOST = "in use", "restarting", "lost"
HEALTH_PROBE_TIMEOUT_S = 10.0  # /health of a failed server: answers at once unless the server is gone or stopped


class ServerPoolError(ServerDiedError):
    """The run cannot go on: no server left in use, or ``max_restarts`` used up."""


def _console(message: str) -> None:
    print(f"hapo rollout: {message}", flush=True)


class ServerSupervisor:
    """Health and replacement of ``servers`` (the engine's list, shared; see the module docstring).

    Args:
        servers: the handles; launched ones (``handle.launch`` set) can be restarted.
        http: the client whose ``request`` reaches them.
        max_restarts: restarts allowed in this process's lifetime (``rollout.sglang.max_restarts``).
        restart: restarts one handle in place (default ``sglang_launch.restart_process``); ``None``:
            this process restarts nothing (servers that fail are ``LOST``).
        log: one console line per event (default: printed with a ``hapo rollout:`` prefix).
        clock: seconds (``time.monotonic``); events carry it, for the recovery-time figures.
    """

    def __init__(self, servers: Sequence[ServerHandle], *, http: SGLangHTTP, max_restarts: int,
                 restart: Optional[Callable[[ServerHandle], None]] = launcher.restart_process,
                 log: Callable[[str], None] = _console, clock: Callable[[], float] = time.monotonic) -> None:
        if int(max_restarts) < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.servers = servers
        self.http, self.max_restarts, self.restart = http, int(max_restarts), restart
        self._log, self._clock = log, clock
        self.state = {i: IN_USE for i in range(len(servers))}
        self.restarts = 0
        self.requests_retried = 0  # rows sent again after their server failed
        self.events: list[tuple[float, int, str, str]] = []  # (time, server index, state entered, reason)
        # SGLang's radix-cache namespace of every /generate from now on (its ``cache_salt``; None: the
        # default one): set by an update that cannot flush the cache (`SGLangEngine.update_weights`)
        self.cache_salt: Optional[str] = None
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ queries
    def in_use(self) -> list[int]:
        with self._lock:
            return [i for i, st in self.state.items() if st == IN_USE]

    def metrics(self) -> dict[str, float]:
        """Totals of this run so far (both count from the start of the process)."""
        return {"rollout/server_restarts": float(self.restarts),
                "rollout/requests_retried": float(self.requests_retried)}

    def _pick(self, key: int) -> int:
        """The in-use server of call ``key`` (round-robin over those in use)."""
        with self._lock:
            live = self.in_use()
            if not live:
                raise ServerPoolError(f"no SGLang server left in use ({self.summary()})")
            return live[key % len(live)]

    def summary(self) -> str:
        return ", ".join(f"{self.servers[i].url}: {st}" for i, st in self.state.items())

    # ------------------------------------------------------------------ requests
    def request(self, key: int, path: str, body: dict, *, rows: int = 1) -> Any:
        """POST ``body`` to an in-use server (round-robin by ``key``), and to the next in-use one
        whenever a server fails (``rows``: the rows the body carries, counted as retried). A
        ``/generate`` carries the current `cache_salt`, also when it goes to another server."""
        while True:
            if path == "/generate" and self.cache_salt is not None:
                body = {**body, "cache_salt": self.cache_salt}
            i = self._pick(key)
            try:
                return self.http.request(self.servers[i], path, body, retry_timeouts=False)
            except RequestRefusedError:
                raise  # the request is wrong, not the server
            except SGLangError as e:
                if not self.is_failure_of_server(i, e):
                    raise
                self.mark_unhealthy(i, first_line(e))
                with self._lock:
                    self.requests_retried += int(rows)

    def is_failure_of_server(self, i: int, error: SGLangError) -> bool:
        """Whether ``error`` (from server ``i``) means the server is unhealthy: its process is
        gone, it did not answer in time (a wedged scheduler may still answer /health), or it
        does not answer ``/health`` now. A server that answers /health and refused with an
        HTTP error is healthy: the error is raised as it is."""
        srv = self.servers[i]
        if self.state[i] != IN_USE or isinstance(error, ServerDiedError) or srv.exit_code() is not None:
            return True  # (out of use: another request found it failed, it may be restarting now)
        if isinstance(error, ServerUnreachableError) and error.timed_out:
            return True
        return not self.http.healthy(srv, timeout_s=HEALTH_PROBE_TIMEOUT_S)

    # ------------------------------------------------------------------ state changes
    def mark_unhealthy(self, i: int, reason: str, *, joining: bool = False) -> None:
        """Take server ``i`` out of use and restart it (when this process launched it); also a
        ``joining`` server (one that failed the sync meant to bring it back). Raises
        :class:`ServerPoolError` past ``max_restarts`` or when no server is left in use."""
        with self._lock:
            if self.state[i] != IN_USE and not joining:
                return  # another request found it first
            srv = self.servers[i]
            self._enter(i, LOST, reason)
            self._log(f"SGLang server {srv.url} is unhealthy ({reason}); {len(self.in_use())} of "
                      f"{len(self.servers)} servers left in use")
            if srv.launch is not None and self.restart is not None:
                self._restart_or_stop(i, reason)
            if not self.in_use():
                raise ServerPoolError(f"no SGLang server left in use after {srv.url} failed ({reason}); "
                                      f"{self.summary()}")

    def _restart_or_stop(self, i: int, reason: str) -> None:
        srv = self.servers[i]
        if self.restarts >= self.max_restarts:
            raise ServerPoolError(f"SGLang server {srv.url} failed ({reason}) after {self.restarts} restart(s): "
                                  f"rollout.sglang.max_restarts={self.max_restarts} used up, stopping")
        self.restarts += 1
        self._log(f"restarting SGLang server {srv.url} (restart {self.restarts} of at most {self.max_restarts}; "
                  f"log {srv.log_path}); it rejoins after the next weight sync that finds it healthy")
        self.restart(srv)
        self._enter(i, RESTARTING, reason)

    def rejoin_candidates(self) -> list[int]:
        """Servers out of use that answer ``/health`` now (a weight sync then includes them).
        A restarted process that has exited is restarted again (within ``max_restarts``)."""
        ready = []
        with self._lock:
            for i, st in list(self.state.items()):
                if st == IN_USE:
                    continue
                srv = self.servers[i]
                if st == RESTARTING and srv.exit_code() is not None:
                    self._log(f"restarted SGLang server {srv.url} exited with code {srv.exit_code()} during start-up")
                    self._restart_or_stop(i, "exited during start-up")
                    continue
                if self.http.healthy(srv, timeout_s=HEALTH_PROBE_TIMEOUT_S):
                    ready.append(i)
        return ready

    def rejoined(self, indices: Sequence[int]) -> None:
        """``indices`` took a whole weight sync: back in use."""
        with self._lock:
            for i in indices:
                if self.state[i] == IN_USE:
                    continue
                since = next(t for t, j, st, _ in reversed(self.events) if j == i and st == LOST)
                self._enter(i, IN_USE, "took the weight sync")
                self._log(f"SGLang server {self.servers[i].url} is back in use with the current weights "
                          f"({self._clock() - since:.1f} s after it was found unhealthy)")

    def _enter(self, i: int, state: str, reason: str) -> None:
        self.state[i] = state
        self.events.append((self._clock(), i, state, reason))


def first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:300]


__all__ = ["ServerSupervisor", "ServerPoolError", "first_line", "IN_USE", "RESTARTING", "LOST",
           "HEALTH_PROBE_TIMEOUT_S"]
