"""SGLang on CPU: import-only stand-ins and a host-cache fix (README.md here), put on the
``PYTHONPATH`` of a CPU SGLang server's processes only (`rollout.sglang.launch.server_env`); never
imported by the trainer. The directory is a package only so that it ships with ``hapo_megatron``.

- ``sitecustomize.py``: run at a server process's start; installs the host-cache fix.
- ``hapo_cpu_host_cache.py``: the fix (a plain CPU allocator for SGLang's host caches).
- ``hapo_inert_stub.py``: makes a package and its sub-modules importable, every name a placeholder.
- ``sgl_kernel/``, ``torchvision/``: the stand-ins SGLang imports unconditionally.
"""

import os

#: the directory a CPU server's PYTHONPATH starts with
DIRECTORY = os.path.dirname(os.path.abspath(__file__))
