"""Running a test on one instruction-set level of the native CPU kernels (kernels/native_libs.py's ISAS)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from stowage.kernels import cpu_decode


@contextmanager
def native_isa(monkeypatch, isa: str):
    """The native libraries built for `isa` inside the block (the test is skipped where the CPU lacks it or the
    library cannot be built); the CPU's own choice again after it."""
    if isa not in cpu_decode.supported_isas():
        pytest.skip(f"this CPU has no {isa}")
    monkeypatch.setenv("STOWAGE_DECODE_ISA", isa)
    cpu_decode.selected_isa.cache_clear()
    try:
        if cpu_decode.current() is None:
            pytest.skip(f"the {isa} library cannot be built here")
        assert cpu_decode.current().decode_isa().decode() == isa
        yield
    finally:
        monkeypatch.undo()
        cpu_decode.selected_isa.cache_clear()
