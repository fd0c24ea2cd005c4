"""Let a daemonic process start child processes for the duration of a block.

WHY: the torch_dist checkpoint writer starts writer processes and a multiprocessing Manager,
which Python refuses inside daemonic processes ("daemonic processes are not allowed to have
children") -- and spawned test ranks are daemonic. The writers are joined before the save
returns, so nothing outlives the block. Active on CPU and GPU alike (it is not a CUDA shim).
"""

from __future__ import annotations

import contextlib
import multiprocessing


@contextlib.contextmanager
def children_allowed():
    config = multiprocessing.current_process()._config  # noqa: SLF001 - no public switch exists
    was = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        if was is not None:
            config["daemon"] = was
