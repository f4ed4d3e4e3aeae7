"""``return_freed_memory``: freed heap memory goes back to the operating system (glibc)."""

from __future__ import annotations

import ctypes.util
import sys

import pytest
import torch

from drmas.infra.memory import return_freed_memory


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None, reason="glibc only")
def test_memory_a_process_freed_is_handed_back():
    # Many tensors below glibc's mmap threshold live on its heap, which keeps them once freed.
    tensors = [torch.ones(16 * 1024) for _ in range(8192)]  # 8192 x 64 KB = 512 MB
    held = _resident_bytes()
    del tensors
    assert return_freed_memory()
    assert _resident_bytes() < held - 256 * 1024 * 1024
