"""Import-only stand-in for ``sgl_kernel`` (no CPU build on the registry); see ../README.md."""
import sys

from hapo_inert_stub import install

install(sys.modules[__name__], "0.0.0+hapo.stand.in")
