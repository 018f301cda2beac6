"""Weight files truncated under a running model: a fault in a watched mapping reads zeros instead of killing the
process (kernels/csrc/fault_guard.c), and the mapping says it faulted, so the step that read it is discarded.

`watch(array)` registers a numpy.memmap's bytes for as long as the mapping lives; `Watched.faulted` is checked after
each step (engine/formats/checkpoint.py, Engine.check_weights). Without a C compiler or a prebuilt library nothing
is watched and a truncation ends the process with SIGBUS, as before (the app's engine child contains that).
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import numpy as np

from .cbuild import load_library
from .native_libs import FAULT_GUARD

_lock = threading.Lock()
_lib: ctypes.CDLL | None | bool = False  # False: not loaded yet


def _library() -> ctypes.CDLL | None:
    global _lib
    if _lib is False:
        lib = load_library(FAULT_GUARD)
        if lib is not None:
            lib.fault_guard_register.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            lib.fault_guard_register.restype = ctypes.c_int
            lib.fault_guard_faulted.argtypes = [ctypes.c_int]
            lib.fault_guard_faulted.restype = ctypes.c_int
            lib.fault_guard_unregister.argtypes = [ctypes.c_int]
            lib.fault_guard_unregister.restype = None
        _lib = lib
    return _lib


class Watched:
    """One mapping's registration: `faulted` once a page of it was read past its file's end."""

    def __init__(self, slot: int | None):
        self.slot = slot

    @property
    def faulted(self) -> bool:
        lib = _library()
        return bool(lib is not None and self.slot is not None and lib.fault_guard_faulted(self.slot))


def watch(mapped: np.memmap) -> Watched:
    """Watch a read-only numpy.memmap's bytes until the memmap object is collected (its views keep it alive, so the
    registration ends no earlier than the mapping). Installs the handler again if another (faulthandler) took it."""
    lib = _library()
    if lib is None or not isinstance(mapped, np.memmap) or mapped.nbytes == 0:  # bytes in memory cannot fault
        return Watched(None)
    with _lock:
        slot = lib.fault_guard_register(mapped.ctypes.data, mapped.nbytes)
    if slot < 0:  # more than the table holds: unwatched, as without the library
        return Watched(None)
    weakref.finalize(mapped, lib.fault_guard_unregister, slot)
    return Watched(slot)
