"""Files written all or nothing: staged in a temporary folder beside the destination, then renamed into place.

A run killed mid-write leaves the previous state whole (no half checkpoint, adapter or
conversion cache). What lands is readable by the machine's other users (0644 files in
0755 folders), like any file a tool writes; `mkdtemp` alone would leave them private.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from remat.base.settings import UsageError


def _publish_modes(folder: Path) -> None:
    mask = os.umask(0)
    os.umask(mask)
    folder.chmod(0o777 & ~mask)
    for p in folder.rglob("*"):
        p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


@contextlib.contextmanager
def staged(dest: str | os.PathLike, mode: Literal["new", "replace", "merge"] = "new", *,
           error: type[Exception] = UsageError) -> Iterator[Path]:
    """Yield a temporary folder whose contents become `dest` when the block succeeds; it vanishes if it fails.

    mode "new": `dest` must not exist (or be an empty folder); "replace": an existing `dest` is replaced;
    "merge": each staged file is moved into the folder `dest` (which may hold other files).
    """
    dest = Path(dest)
    if mode == "new" and dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise error(f"'{dest}' exists and is not an empty folder: refusing to overwrite it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
        _publish_modes(tmp)
        if mode == "merge":
            dest.mkdir(exist_ok=True)
            for f in sorted(tmp.iterdir()):
                os.replace(f, dest / f.name)
            return
        if mode == "replace" and dest.exists():
            shutil.rmtree(dest)
        try:
            os.replace(tmp, dest)  # atomic: readers see no folder or a complete one
        except OSError as e:
            raise error(f"cannot create '{dest}': {e.strerror}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def staged_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path that becomes `path` when the block succeeds."""
    path = Path(path)
    with staged(path.parent, mode="merge") as tmp:
        yield tmp / path.name


def listing(folder: Path, final: Path) -> list[str]:
    """The files under `folder`, named as they will be once `folder` is `final`."""
    return sorted(str(final / p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def remove_stale(folder: Path) -> list[Path]:
    """Remove what `staged` left in `folder` when its process was killed mid-write (`.<name>.tmp-*`): no live
    write is there when its owner (a job being started, a server starting) calls this. Returns what went."""
    stale = sorted(folder.glob(".*.tmp-*")) if folder.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return stale
