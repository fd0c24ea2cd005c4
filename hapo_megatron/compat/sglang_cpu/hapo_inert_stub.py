"""Import-only stand-ins for GPU-only packages that SGLang imports unconditionally (tooling, not
part of hapo_megatron; see README.md next to this file).

``install(package)`` makes ``package`` and every ``package.sub.module`` importable; any name taken
from them is an :class:`Unavailable` placeholder: attribute access gives further placeholders (so
``from torchvision.transforms import InterpolationMode; InterpolationMode.BICUBIC`` works at import
time), but CALLING one raises ``NotImplementedError`` naming it, so a test notices at once when
SGLang starts to need the real kernel / library.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class Unavailable:
    """A name from a stand-in package: fine to import and look at, an error to call."""

    def __init__(self, qualname: str) -> None:
        object.__setattr__(self, "_qualname", qualname)

    def __getattr__(self, name: str) -> "Unavailable":
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{self._qualname}.{name}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self._qualname} was called, but this is an import-only stand-in "
            "(hapo_megatron/compat/sglang_cpu): the real package is needed for this code path")

    def __repr__(self) -> str:
        return f"<unavailable {self._qualname}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.package + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []  # a package: sub-modules resolve through this finder too
        return module

    def exec_module(self, module) -> None:
        pass


def install(package_module: types.ModuleType, version: str) -> None:
    """Turn the (already imported) top-level stand-in ``package_module`` into an inert package."""
    package_module.__class__ = _StubModule
    package_module.__version__ = version
    package_module.__hapo_stand_in__ = True
    sys.meta_path.append(_Finder(package_module.__name__))
