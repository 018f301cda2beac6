"""Every native library Stowage builds from kernels/csrc, in one table: sources, flags and what the CPU must have.

Plain data (no torch), so `kernels/build.py` can build them all when the package is built, and the
modules that load them (cpu_gemv.py, cpu_quant.py, cpu_decode.py) read their flags from here.
"""

from __future__ import annotations

from dataclasses import dataclass

_X86 = ["-mavx2", "-mfma", "-mf16c"]
_X86_NEEDS = {"avx2", "fma", "f16c"}
# VNNI (Cascade Lake, Ice Lake, Zen 4 on) for the integer dots of quant_x86.h; AVX-512 CPUs without it
# (Skylake-SP/X) run the avx2 level
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
_AVX512_NEEDS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
# Instruction-set levels: compiler flags and the /proc/cpuinfo flags they need, best first.
ISAS: dict[str, tuple[list[str], set[str]]] = {
    "avx512bf16": ([*_AVX512, "-mavx512bf16", *_X86], _AVX512_NEEDS | {"avx512_bf16"} | _X86_NEEDS),
    "avx512": ([*_AVX512, *_X86], _AVX512_NEEDS | _X86_NEEDS),
    "avx2": (_X86, _X86_NEEDS),
    "scalar": ([], set()),
}


@dataclass(frozen=True)
class NativeLibrary:
    """One shared library: built from `sources` (in kernels/csrc) with `flags`, runnable where the CPU has `needs`."""

    name: str
    sources: tuple[str, ...]
    flags: tuple[str, ...]
    libs: tuple[str, ...] = ()
    needs: frozenset[str] = frozenset()


GEMV_BF16 = NativeLibrary("gemv_bf16", ("gemv_bf16.c", "bf16.h"),
                          ("-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC"),
                          needs=frozenset({"avx512_bf16", "avx512bw"}))


def quant_gemv(isa: str) -> NativeLibrary:
    """kernels/cpu_quant.py's matrix-vector products on ggml blocks (its levels stop at avx512)."""
    return NativeLibrary(f"quant_gemv_{isa}", ("quant_gemv.c", "quant_dots.h", "quant_blocks.h", "quant_x86.h"),
                         ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", *ISAS[isa][0]),
                         needs=frozenset(ISAS[isa][1]))


# decode_layer.c and every header it includes (the build's digest covers them all)
DECODE_LAYER_SOURCES = ("decode_layer.c", "decode_types.h", "vec_math.h", "thread_pool.h", "row_dots.h",
                        "decode_scratch.h", "decode_attention.h", "prefill_attention.h", "prefill_lanes.h",
                        "prefill_bf16.h", "bf16.h", "quant_dots.h", "quant_blocks.h", "quant_x86.h",
                        "quant_matmul.h")


def decode_layer(isa: str) -> NativeLibrary:
    """kernels/cpu_decode.py's decode step (and kernels/cpu_attention.py's prefill attention)."""
    return NativeLibrary(f"decode_layer_{isa}", DECODE_LAYER_SOURCES,
                         ("-O3", "-ffp-contract=off", "-shared", "-fPIC", "-pthread", *ISAS[isa][0]), ("-lm",),
                         frozenset(ISAS[isa][1]))


QUANT_ISAS = ("avx512", "avx2", "scalar")


def supported(levels, flags: set[str]) -> list[str]:
    """The levels (names in ISAS) a CPU with these /proc/cpuinfo flags runs, best first."""
    return [isa for isa in levels if ISAS[isa][1] <= flags]


def choose(levels, flags: set[str], env: str, environ) -> str | None:
    """`environ[env]` if set (None when the CPU lacks it; a name not in levels is a ValueError), else the best."""
    forced = environ.get(env, "")
    if forced and forced not in levels:
        raise ValueError(f"{env}={forced!r} is not one of {', '.join(levels)}")
    runs = supported(levels, flags)
    if forced:
        return forced if forced in runs else None
    return runs[0]


# kernels/fault_guard.py's SIGBUS handler: a weights file truncated under a running model (any CPU)
FAULT_GUARD = NativeLibrary("fault_guard", ("fault_guard.c",), ("-O2", "-shared", "-fPIC"))


def all_libraries() -> list[NativeLibrary]:
    return [GEMV_BF16, *(quant_gemv(i) for i in QUANT_ISAS), *(decode_layer(i) for i in ISAS), FAULT_GUARD]
