"""A source file of the package built once per machine into a shared library, and loaded by ctypes.

The library is kept under the user's cache folder, named by the source's stem and a hash of the source, the
compiler, the flags and what else it was built for (a CPU's features, torch's version), so a change to any builds
it again; the builds of an earlier source are removed. It is built aside and renamed into place: processes may race.
Where the machine has no compiler or the build fails, the caller is told once (a `Note`) and gets None.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

from remat.base.settings import Note


def _cache_folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "remat"


def _build(compiler: str, source: Path, flags: Sequence[str], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        subprocess.run([compiler, str(source), "-o", str(built), *flags], check=True, capture_output=True, timeout=120)
        os.replace(built, path)
    for old in path.parent.glob(f"{source.stem}-*.so"):  # those of an earlier source; a process using one keeps it
        if old != path:
            old.unlink(missing_ok=True)


def load(source: Path, flags: Sequence[str], *, cpp: bool, built_for: object, what: str, without: str
         ) -> ctypes.CDLL | None:
    """`source` built with the machine's C (`cpp` False: $CC, cc, gcc) or C++ compiler ($CXX, c++, g++) and loaded;
    None, said once as "`what` did not build (why): `without`", where it cannot be."""
    names = ("CXX", "c++", "g++") if cpp else ("CC", "cc", "gcc")
    compiler = os.environ.get(names[0]) or shutil.which(names[1]) or shutil.which(names[2])
    if compiler is None:
        warnings.warn(f"no {'C++' if cpp else 'C'} compiler ({names[1]}): {without}", Note, stacklevel=3)
        return None
    key = hashlib.sha256(source.read_bytes() + repr((compiler, tuple(flags), built_for)).encode()).hexdigest()[:16]
    path = _cache_folder() / f"{source.stem}-{key}.so"
    try:
        if not path.exists():
            _build(compiler, source, flags, path)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        said = e.stderr.decode(errors="replace").strip() if isinstance(e, subprocess.CalledProcessError) else e
        warnings.warn(f"{what} did not build ({said}): {without}", Note, stacklevel=3)
        return None
