"""Worker threads that leave the compute thread's cores alone: every engine pool is made here.

ATen runs a parallel op on an OpenMP team sized by the calling thread's ``omp_get_max_threads``. A
worker thread (prefetch, gradient offload, block update, disk I/O) with the default size starts a team
of its own beside the compute thread's, and libgomp, seeing more busy threads than cores, drops to its
short-spin mode: the compute thread's teams then fall asleep between ops and wake up slowly (two idle
workers that had run one parallel op each slowed a plain 170M Llama step on two cores by 10%:
``benchmarks/RESULTS.md``; ``benchmarks/repro_threads.py`` times an ``mm`` loop beside workers). So
each worker sets its own size first, through the OpenMP runtime that torch loaded:
``omp_set_num_threads`` changes only the calling thread. ``torch.set_num_threads`` would not do: it
also sets MKL's process-wide count and ATen's default for every thread that has not run a parallel op
yet, the compute thread included.

Sizes: where the compute device is the CPU every worker runs single-threaded (compute uses every core);
on an accelerator the compute thread mostly launches kernels, so the workers doing bulk host work
(block updates, gradient sums) get the cores it leaves. Where no OpenMP runtime is found in the process
(a build on another runtime, no ``/proc``), workers keep the runtime's default size; on the CPU over a
store in RAM, block updates then still run in the compute thread (``update_workers``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

log = logging.getLogger(__name__)

_OPENMP_LIBRARY = re.compile(r"/lib(gomp|omp|iomp5)[^/]*\.so[^/]*$")


def worker_pool(workers: int, name: str, threads: int = 1) -> ThreadPoolExecutor:
    """``workers`` threads named ``name``, each running its parallel ops on ``threads`` OpenMP threads."""
    return ThreadPoolExecutor(
        workers, thread_name_prefix=name, initializer=limit_this_thread, initargs=(threads,)
    )


def bulk_threads(device: torch.device, workers: int) -> int:
    """OpenMP threads for each of ``workers`` workers doing the host's bulk work (block updates, gradient
    sums) beside compute on ``device``: one where compute runs on the CPU; on an accelerator, the cores
    the compute thread leaves, split between them."""
    if device.type == "cpu":
        return 1
    return max(1, (torch.get_num_threads() - 1) // workers)


def update_workers(device: torch.device, host_tier: bool, requested: int | None) -> int:
    """Worker threads for block updates: ``requested``, or by default none where compute runs on the CPU
    over a store in RAM (an update beside compute's ops, which use every core, only stalls their OpenMP
    teams, and has no I/O to wait for: it runs at full width in the compute thread once its block's
    gradients are final), else one."""
    if requested is not None:
        return requested
    return 0 if device.type == "cpu" and host_tier else 1


def limit_this_thread(threads: int) -> None:
    """Run this thread's parallel ops on ``threads`` OpenMP threads; other threads keep theirs."""
    set_threads = _omp_set_num_threads()
    if set_threads is None:
        return
    # ATen sizes a thread on its first parallel op (or query), which would undo a size set before.
    torch.get_num_threads()
    set_threads(threads)


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the OpenMP runtime torch loaded (its own copy first), or ``None``."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if _OPENMP_LIBRARY.search(line.rstrip())}
    except OSError:
        paths = set()
    torch_dir = os.path.dirname(torch.__file__)
    for path in sorted(paths, key=lambda p: not p.startswith(torch_dir)):
        try:
            library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            function = library.omp_set_num_threads
        except (OSError, AttributeError):
            continue
        function.argtypes, function.restype = [ctypes.c_int], None
        return function
    log.debug("megatrain: no OpenMP runtime found in this process; worker threads keep its default size")
    return None
