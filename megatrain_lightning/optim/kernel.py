"""The compiled quantized-AdamW kernel: built once per machine, loaded once per process.

It also rounds weights to bf16 for the host tier's shadow (:mod:`.bf16`): inside the quantized step, and
on its own after torch's Adam for fp32 moments.

``csrc/quantized_adamw.cpp`` (with the headers beside it: one translation unit) is compiled with the
system C++ compiler (no torch headers, no ninja) into a per-user cache: ``$MEGATRAIN_KERNEL_CACHE``, else
``$XDG_CACHE_HOME/megatrain_lightning/kernels``, else ``~/.cache/megatrain_lightning/kernels``, else
(when none of those can be created) a folder of the user's own under the temp dir. A cache folder or
library is used only when it belongs to the current user and nobody else may write to it: a library
someone else could replace would run their code in this process. :func:`prepare` builds it at ``setup``,
on the main thread and with a log line while the compiler runs, so no training step waits for a compiler.
When no compiler is found or the build fails, the pure-torch fallback in :mod:`.quantized` runs
(identical results, slower) and one warning says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info

from megatrain_lightning.optim import codecs, rounding

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "quantized_adamw.cpp"
_ABI_VERSION = 7
_TABLE_FLOATS = 129
_BASE_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno"]
# tried in this order; the first that compiles is used (without OpenMP the kernel runs on one thread)
_ARCH_FLAGS = [["-march=native", "-fopenmp"], ["-fopenmp"], ["-march=native"], []]
_COMPILE_TIMEOUT_S = 300


def _expected_tables() -> torch.Tensor:
    """What ``mq_tables`` must report: codecs.py's formats and maps (see the C++ source)."""
    formats = [codecs.FORMATS[b] for b in (8, 4, 3, 2)]
    layout = torch.tensor([x for f in formats for x in (f.m_bits, f.m_block, f.v_bits, f.v_block)])
    m4, v4, v2 = codecs.FORMATS[4], codecs.FORMATS[4], codecs.FORMATS[3]
    m2, v8 = codecs.FORMATS[2], codecs.FORMATS[8]
    return torch.cat([
        layout.float(), m4.m_table, m2.m_table, m4.m_midpoints, m2.m_midpoints,
        v4.v_table, v2.v_table, v4.v_thresholds, v2.v_thresholds, torch.tensor([codecs.V_FLOOR]),
        v8.v_table[:16], v8.v_thresholds[:16],
        torch.tensor([float(codecs.FORMATS[b].v_root_rounding) for b in (4, 3, 2)]),
        torch.tensor([rounding.quarter_root_step(v2.v_octaves)]),
    ])  # fmt: skip


class _Kernel:
    def __init__(self, path: Path) -> None:
        if not _trusted(path):
            raise RuntimeError(f"{path} is not owned by this user or is writable by others; not loaded")
        lib = ctypes.CDLL(str(path))
        lib.mq_abi_version.restype = ctypes.c_int
        if lib.mq_abi_version() != _ABI_VERSION:
            raise RuntimeError(f"{path} has ABI {lib.mq_abi_version()}, expected {_ABI_VERSION}")
        lib.mq_tables.argtypes = [ctypes.c_void_p]
        tables = torch.zeros(_TABLE_FLOATS, dtype=torch.float32)
        lib.mq_tables(tables.data_ptr())
        if not torch.equal(tables, _expected_tables()):
            raise RuntimeError(f"{path} was built with other codec formats or tables than codecs.py")
        lib.mq_isa.restype = ctypes.c_char_p
        self.isa = lib.mq_isa().decode()
        fn = lib.mq_adamw_step
        fn.restype = ctypes.c_int
        fn.argtypes = [
            *[ctypes.c_void_p] * 7,
            ctypes.c_int64,
            ctypes.c_int,
            ctypes.c_void_p,
            *[ctypes.c_int] * 4,
            ctypes.c_uint32,
            ctypes.c_uint32,
            ctypes.c_int64,
        ]
        self.step = fn
        to_bf16 = lib.mq_to_bf16
        to_bf16.restype = ctypes.c_int
        to_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        self.to_bf16 = to_bf16
        self.path = path


_lock = threading.Lock()
_kernel: _Kernel | None = None
_kernel_error: str | None = None  # why the kernel is unavailable (then the fallback runs)
_warned = False


def cache_dir() -> Path:
    """Where compiled kernels are kept (one file per source / compiler / CPU combination)."""
    if env := os.environ.get("MEGATRAIN_KERNEL_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatrain_lightning" / "kernels"


def _trusted(path: Path) -> bool:
    """Owned by this user and not writable by group or others."""
    info = path.stat()
    owner = getattr(os, "getuid", lambda: info.st_uid)()
    return info.st_uid == owner and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _compiler() -> str | None:
    for name in filter(None, (os.environ.get("CXX"), "c++", "g++", "clang++")):
        if path := shutil.which(name):
            return path
    return None


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("flags", "Features", "model name", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _writable_cache() -> Path:
    """The first candidate cache folder that can be created (private to this user) and is trusted."""
    user = getattr(os, "getuid", lambda: 0)()
    tried = []
    for folder in (cache_dir(), Path(tempfile.gettempdir()) / f"megatrain_lightning-kernels-{user}"):
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            if os.access(folder, os.W_OK) and _trusted(folder):
                return folder
            tried.append(f"{folder} (not writable, not owned by this user, or writable by others)")
        except OSError as err:
            tried.append(f"{folder} ({err})")
    raise RuntimeError(f"no usable folder for the compiled kernel; tried {'; '.join(tried)}")


def _source_bytes() -> bytes:
    """The kernel's source as the cache key sees it: the ``.cpp`` and every header beside it, by name."""
    files = [_SOURCE, *sorted(_SOURCE.parent.glob("*.h"))]
    return b"\0".join(f.name.encode() + b"\0" + f.read_bytes() for f in files)


def _build(compiler: str, archs: list[list[str]] = _ARCH_FLAGS) -> Path:
    source = _source_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    errors = []
    for arch in archs:
        flags = [*_BASE_FLAGS, *arch]
        key = hashlib.sha256(
            b"\0".join(
                s if isinstance(s, bytes) else s.encode()
                for s in (
                    source,
                    version,
                    " ".join(flags),
                    platform.machine(),
                    _cpu_signature(),
                    str(_ABI_VERSION),
                )
            )
        ).hexdigest()[:16]
        target = _writable_cache() / f"quantized_adamw-{key}.so"
        if target.exists():
            return target
        rank_zero_info(f"megatrain: compiling the CPU AdamW kernel (once; cached in {target.parent})")
        # build under a unique name, then rename: concurrent processes never load a half-written file
        fd, tmp = tempfile.mkstemp(suffix=".so", prefix=".build-", dir=target.parent)
        os.close(fd)
        try:
            result = subprocess.run(
                [compiler, *flags, str(_SOURCE), "-o", tmp],
                capture_output=True,
                text=True,
                timeout=_COMPILE_TIMEOUT_S,
            )
            if result.returncode == 0:
                os.chmod(tmp, 0o755)
                os.replace(tmp, target)
                return target
            errors.append(f"{' '.join(arch) or 'generic'}: {result.stderr.strip()[-2000:]}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError("compiling the quantized AdamW kernel failed:\n" + "\n".join(errors))


def load_kernel() -> _Kernel | None:
    """The compiled kernel (built on first call, thread-safe), or None when only the fallback can run."""
    global _kernel, _kernel_error
    if _kernel is not None or _kernel_error is not None:
        return _kernel
    with _lock:
        if _kernel is not None or _kernel_error is not None:
            return _kernel
        if os.environ.get("MEGATRAIN_QUANTIZED_BACKEND", "").lower() == "torch":
            _kernel_error = "MEGATRAIN_QUANTIZED_BACKEND=torch"
            return None
        try:
            compiler = _compiler()
            if compiler is None:
                raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
            path = _build(compiler)
            try:
                _kernel = _Kernel(path)
            except OSError:  # a damaged cached build: rebuild it once
                path.unlink(missing_ok=True)
                _kernel = _Kernel(_build(compiler))
        except Exception as err:  # any failure: fall back to torch, once, loudly
            _kernel_error = f"{type(err).__name__}: {err}"
        return _kernel


def prepare() -> str:
    """Build or find the kernel now (at ``setup``, before the first step), saying so while it compiles
    (:func:`_build`; a cached build loads quietly); returns :func:`backend`."""
    if _kernel is None and _kernel_error is None:
        start = time.perf_counter()
        load_kernel()
        seconds = time.perf_counter() - start
        if seconds >= 1:
            rank_zero_info(f"megatrain: AdamW kernel {backend()} ready in {seconds:.1f} s")
    if _kernel is None:
        warn_fallback()
    return backend()


def unavailable_reason() -> str | None:
    return _kernel_error


def backend() -> str:
    """``"cpp-avx512"`` / ``"cpp-avx2"`` / ``"cpp-generic"`` when the kernel runs, ``"torch"`` for the
    fallback."""
    kernel = load_kernel()
    return f"cpp-{kernel.isa}" if kernel is not None else "torch"


def warn_fallback() -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning(
            "megatrain: the compiled quantized-AdamW kernel is unavailable (%s); using the pure-torch "
            "fallback, which gives identical results but is several times slower.",
            _kernel_error,
        )


def kernel_for(use_kernel: bool | None) -> _Kernel | None:
    """The compiled kernel a call uses: ``None`` for the torch fallback (forced by ``use_kernel=False``,
    else where the kernel is unavailable, with a warning once); ``use_kernel=True`` requires it."""
    compiled = load_kernel() if use_kernel is not False else None
    if compiled is None and use_kernel:
        raise RuntimeError(f"the compiled AdamW kernel is unavailable: {unavailable_reason()}")
    if compiled is None and use_kernel is None:
        warn_fallback()
    return compiled
