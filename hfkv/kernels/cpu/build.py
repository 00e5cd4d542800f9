"""Compiling the CPU kernels on first use, once per machine.

The kernels are plain C++ behind a C ABI (no Python or torch headers), so a build is one compiler call
of about a second, and the library is loaded with ctypes. It is built for the CPU it runs on
(``-march=native``: the decode loops are only fast when vectorised for the machine's widest SIMD) and
cached under ``$HFKV_CACHE_DIR`` (default ``~/.cache/hfkv``) by a key over the source, the compiler, the
flags and the CPU's feature flags, so a home directory shared by different machines never loads a
library built for another CPU. The library is written to a temporary file and renamed into place, so
two processes building at once never load half a file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "paged_decode.cpp",
        "observation.cpp",
        "allocate.cpp",
        "encode.cpp",
        "meta.cpp",
        "compact.cpp",
        "reserve.cpp",
    )
)
HEADERS = (Path(__file__).with_name("simd.h"),)  # included by the sources: part of what a build's name hashes
FLAGS = ("-O3", "-std=c++17", "-fopenmp-simd", "-fPIC", "-shared", "-fno-math-errno")
ARCH_FLAGS = ("-march=native",)
# Threads through the OpenMP runtime torch loaded: both name libgomp.so.1, so the library binds to torch's
# copy and its threads are torch's (a second runtime would spin on the same cores between calls).
OPENMP_FLAGS = ("-fopenmp",)


class CpuKernelUnavailable(RuntimeError):
    """The CPU kernels could not be built on this machine (no C++ compiler, or the build failed)."""


def compiler() -> str | None:
    """The C++ compiler to use: ``$CXX``, else the first of g++, c++, clang++ on the PATH."""
    env = os.environ.get("CXX")
    if env:
        return env
    for name in ("g++", "c++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("HFKV_CACHE_DIR") or Path.home() / ".cache" / "hfkv") / "kernels"


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise CpuKernelUnavailable(f"hfkv CPU kernels: the C++ compiler {cxx!r} does not run ({err})") from err


def _compile(cxx: str, flags: tuple[str, ...], target: Path) -> subprocess.CompletedProcess:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cxx, *flags, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True, timeout=300)
        if done.returncode == 0:
            os.replace(tmp, target)
        return done
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@cache
def library() -> ctypes.CDLL:
    """The compiled kernels (built now if this machine has no cached build); raises CpuKernelUnavailable."""
    import torch  # noqa: F401  (loads torch's libgomp first, so the library's libgomp.so.1 resolves to it)

    cxx = compiler()
    if cxx is None:
        raise CpuKernelUnavailable(
            "hfkv CPU kernels need a C++ compiler (g++ or clang++, or set CXX) to build on first use; none was "
            "found. Install one, or use TriStateConfig.backend='torch'."
        )
    version = _version(cxx)
    errors = []
    # A compiler without OpenMP or -march=native still builds (single-threaded, or generic SIMD).
    for flags in (FLAGS + OPENMP_FLAGS + ARCH_FLAGS, FLAGS + OPENMP_FLAGS, FLAGS + ARCH_FLAGS, FLAGS):
        texts = [src.read_text() for src in (*SOURCES, *HEADERS)]
        key = hashlib.sha256("\0".join([*texts, cxx, version, *flags, _cpu_features()]).encode())
        target = cache_dir() / f"hfkv_cpu-{key.hexdigest()[:20]}.so"
        if not target.exists():
            done = _compile(cxx, flags, target)
            if done.returncode != 0:
                errors.append(f"{cxx} {' '.join(flags)}: {done.stderr.strip()[-2000:]}")
                continue
        try:
            return ctypes.CDLL(str(target))
        except OSError as err:  # e.g. an OpenMP runtime older than the compiler's
            errors.append(f"loading {target}: {err}")
    raise CpuKernelUnavailable("hfkv CPU kernels failed to build:\n" + "\n".join(errors))


@cache
def available() -> bool:
    """Whether the CPU kernels build and load here (what ``backend='auto'`` on a CPU asks)."""
    try:
        library()
    except CpuKernelUnavailable:
        return False
    return True


_CTYPES = {"p": ctypes.c_void_p, "i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float}


@cache
def function(name: str, args: str, returns: str | None = None):
    """The library's C function ``name`` with its ctypes signature: ``args`` one code per parameter (``p``
    pointer, ``i32``, ``i64``, ``f32``) separated by spaces, ``returns`` one code or None (void)."""
    fn = getattr(library(), name)
    fn.argtypes = [_CTYPES[a] for a in args.split()]
    fn.restype = None if returns is None else _CTYPES[returns]
    return fn
