"""What the process really uses: anonymous (private) memory, RSS, and CUDA allocations."""

from __future__ import annotations

import os

import psutil


def anonymous_bytes() -> int:
    """Private anonymous memory of this process (heap, torch allocations); mapped files excluded."""
    try:
        with open(f"/proc/{os.getpid()}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Anonymous:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    # Elsewhere USS is the nearest figure (it also counts file pages only we map).
    return psutil.Process().memory_full_info().uss


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss
