"""What this machine's CPU offers drmas's torch work: its threads, and native bf16."""

from __future__ import annotations

import os


def cpu_threads() -> int:
    """``OMP_NUM_THREADS`` when it is set to a positive number, else every core.

    torch reads the same variable for its own default, so setting it is how a user shares
    one machine between jobs (a test runner with several workers, two runs side by side):
    the pool's workers and the warm starts divide these threads instead of each taking every
    core, which on a small machine makes them several times slower than one thread each."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.strip().isdigit() and int(value) > 0:
        return int(value)
    return os.cpu_count() or 1


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 or AMX, as oneDNN requires). Without
    it torch emulates bf16: a SmolLM2-sized matmul and its backward took 12.6x float32's
    time on an AVX2-only EPYC, where with AMX bf16 is 1.4-1.6x faster than float32."""
    import torch  # noqa: PLC0415 - only asked when a bf16 group would train here

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
