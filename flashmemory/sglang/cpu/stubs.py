"""Stand-ins for the CUDA-only kernel wheels (`sgl_kernel`, `flash_mla`) when they cannot load on this host.

Both wheels raise at import without `libcuda.so.1`, and ~100 sglang modules import names from them at module
level. A stub module answers every attribute with a function that raises `CpuKernelMissing` naming the kernel,
so importing works and only a call that has no torch fallback fails, loudly. Pure-Python submodules of a stubbed
wheel (e.g. `sgl_kernel.scalar_type`) are loaded from the wheel's own files; one whose import fails becomes a stub
too. A wheel that imports fine is left alone. Installed once per process by the platform plugin, before sglang
imports them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types

logger = logging.getLogger(f"sglang.{__name__}")  # under "sglang": its log handler prints it


class CpuKernelMissing(RuntimeError):
    """A CUDA-only kernel was called on the CPU path and no torch fallback covers it."""


def _missing(qualname: str):
    def kernel(*args, **kwargs):
        raise CpuKernelMissing(
            f"{qualname} is a CUDA kernel with no torch fallback in flashmemory.sglang.cpu (SGLANG_FLASHMEMORY_CPU=1)"
        )

    kernel.__name__ = qualname.rsplit(".", 1)[-1]
    kernel.__qualname__ = qualname
    kernel.flashmemory_cpu_stub = True
    return kernel


class StubModule(types.ModuleType):
    """A package whose every missing attribute is a raising kernel stand-in (dunder lookups stay AttributeError)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        fn = _missing(f"{self.__name__}.{name}")
        setattr(self, name, fn)
        return fn


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        mod = StubModule(spec.name)
        mod.__path__ = list(spec.submodule_search_locations or [])
        mod.flashmemory_cpu_stub = True
        return mod

    def exec_module(self, module):
        return None


class _RealOrStubLoader(importlib.abc.Loader):
    """Runs a real submodule file; if that raises (it needs the CUDA ops), the module becomes a stub instead."""

    def __init__(self, real: importlib.abc.Loader):
        self.real = real

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        try:
            self.real.exec_module(module)
        except Exception as e:
            logger.debug("FlashMemory CPU: %s did not import (%s); stubbed", module.__name__, e)
            keep = {
                k: module.__dict__[k]
                for k in ("__name__", "__spec__", "__loader__", "__path__", "__file__")
                if k in module.__dict__
            }
            module.__dict__.clear()
            module.__dict__.update(keep)
            module.__class__ = StubModule
            module.flashmemory_cpu_stub = True


class StubFinder(importlib.abc.MetaPathFinder):
    """Answers imports of the stubbed packages: the top level is a `StubModule` (its `__init__` loads the CUDA
    ops); submodules run from the wheel's files when they can."""

    def __init__(self, packages: dict[str, list[str]]):
        self.packages = packages  # name -> the real package's search path

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.split(".", 1)[0]
        if top not in self.packages:
            return None
        if fullname == top:
            spec = importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
            spec.submodule_search_locations = list(self.packages[top])
            return spec
        real = importlib.machinery.PathFinder.find_spec(fullname, path)
        if real is None or real.loader is None:
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        real.loader = _RealOrStubLoader(real.loader)
        return real


def _loads(name: str) -> bool:
    """True if the real package imports here (it needs libcuda on import; on a GPU host it is kept)."""
    if name in sys.modules:
        return not getattr(sys.modules[name], "flashmemory_cpu_stub", False)
    if importlib.util.find_spec(name) is None:
        return False
    try:
        importlib.import_module(name)
        return True
    except Exception:  # OSError / ImportError from the CUDA libraries, and whatever else their init raises
        for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[mod]
        return False


def install_stubs(packages: tuple[str, ...]) -> list[str]:
    """Stub each package that cannot load (the `import_stub` rows of `cpu/platform.py`); returns the stubbed
    names. Idempotent."""
    if any(isinstance(f, StubFinder) for f in sys.meta_path):
        return [p for p in packages if getattr(sys.modules.get(p), "flashmemory_cpu_stub", False)]
    todo = {}
    for p in packages:
        if not _loads(p):
            spec = importlib.util.find_spec(p)
            todo[p] = list(spec.submodule_search_locations or []) if spec is not None else []
    if todo:
        sys.meta_path.insert(0, StubFinder(todo))
        logger.info("FlashMemory CPU: stubbed CUDA-only packages %s", ", ".join(todo))
    return list(todo)
