"""Keep freed tensor memory in the process instead of handing it back to the kernel (glibc only).

Why: CPU tensors come from `malloc`. glibc serves large blocks with fresh `mmap`s and trims the
heap top as soon as a few MB are free, so every GRPO step asks the kernel again for the same
tens of MB of activations and gradients, and each of their 4 KiB pages is zero-filled on first
touch: thousands of page faults per step on a small model (bench/README.md, "Measured reasons").

`keep_freed_memory()` raises glibc's mmap and trim thresholds (the same knobs as the
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ environment variables), so a step reuses the
previous step's pages. Blocks over the mmap threshold (32 MiB, glibc's maximum) are still
mapped and unmapped per use. Peak RSS is unchanged (the pages were resident at the peak anyway);
the process just does not shrink between steps. Elsewhere than glibc Linux it does nothing.

`return_freed_memory()` is the opposite, for a rank of an fsdp job: it gathers each layer's weights (and
their gradients) for a moment, many times a step, and frees them after. Kept in the process, those blocks
(and the holes between them in the heap) make each rank's resident memory several times what its shards
and one gathered layer need. A fixed mmap threshold of 1 MiB (fixed: glibc's own threshold rises with every
block freed, which would put the next gathers back on the heap) maps every block of that size or more on its
own and unmaps it when freed, at the price of zero-filled pages for each.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# glibc caps the mmap threshold at HEAP_MAX_SIZE / 2: 32 MiB on 64-bit.
MMAP_THRESHOLD = 32 * 2**20
# Free memory at the heap top kept before trimming: well above one step's working set.
TRIM_THRESHOLD = 1024 * 2**20
# return_freed_memory: blocks from this size up are mapped on their own (a gathered layer's tensors are larger).
RETURN_MMAP_THRESHOLD = 2**20
RETURN_TRIM_THRESHOLD = 128 * 2**10  # glibc's default

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the thresholds once per process; True when glibc accepted them."""
    global _applied
    if _applied is None:
        _applied = _mallopt({_M_MMAP_THRESHOLD: MMAP_THRESHOLD, _M_TRIM_THRESHOLD: TRIM_THRESHOLD})
    return _applied


def return_freed_memory() -> bool:
    """Hand large freed blocks back to the kernel (the module docstring says when); True when glibc accepted."""
    return _mallopt({_M_MMAP_THRESHOLD: RETURN_MMAP_THRESHOLD, _M_TRIM_THRESHOLD: RETURN_TRIM_THRESHOLD})


def _mallopt(settings: dict[int, int]) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in settings.items())
