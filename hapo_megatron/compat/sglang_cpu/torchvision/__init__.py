"""Import-only stand-in for ``torchvision`` (the registry's wheel needs CUDA torch); see ../README.md."""
import sys

from hapo_inert_stub import install

install(sys.modules[__name__], "0.0.0+hapo.stand.in")
