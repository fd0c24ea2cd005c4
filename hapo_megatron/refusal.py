"""One line for every refusal (docs/troubleshooting.md, "Refusals"): a config, a path or the
hardware that a command refuses is printed as ``<prog>: error: <why>`` on one line (rank 0 only
under torchrun) and the command exits with `REFUSED`, never with a traceback.

Under torchrun a rank's non-zero exit always ends in torchrun's own ``ChildFailedError`` report
(torch 2.13: ``launch_agent`` raises it for any failed worker and ``torch.distributed.run.main``
re-raises it), so the launcher scripts run ``python -m hapo_megatron.train --check`` first and
refuse before torchrun starts; a rank that refuses anyway also writes its line into torchrun's
error file, so that report's root cause is the refusal rather than a pointer to the docs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import NoReturn

REFUSED = 2  # bad input or hardware: nothing was run
NOTHING_TO_DO = 3  # `hapo train --check` only: the run is finished (the launcher then exits 0)


def refuse(prog: str, why: object, *, rank: int = 0) -> int:
    """Print ``<prog>: error: <why>`` (rank 0) and leave it in torchrun's error file (every rank
    torchrun started); returns `REFUSED`."""
    line = f"{prog}: error: {' '.join(str(why).split(chr(10)))}"
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
    write_elastic_error_file(line)
    return REFUSED


def write_elastic_error_file(line: str) -> None:
    """The error file torchrun reads for a failed worker (``TORCHELASTIC_ERROR_FILE``; absent
    outside torchrun): its report shows ``line`` as the worker's traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the line is printed already; the report then points to torchrun's docs


def path_error_line(err: OSError) -> str:
    """``<what is wrong>: <path>`` of an OSError about a path (FileNotFoundError, IsADirectoryError...)."""
    what = err.strerror or type(err).__name__
    return f"{what}: {err.filename}" if err.filename else str(err)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``<prog>: error: <message> (<prog> --help)``)
    on rank 0, exit `REFUSED`: not argparse's usage block, once per torchrun rank."""

    def error(self, message: str) -> NoReturn:
        sys.exit(refuse(self.prog, f"{message} (see {self.prog} --help)", rank=int(os.environ.get("RANK", 0))))
