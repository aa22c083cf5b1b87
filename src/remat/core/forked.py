"""Independent work side by side in forked processes: `remat plan --ctx max` searches the window path here while a
child searches the walk (each search is Python-bound planning: one core each)."""

from __future__ import annotations

import os
import pickle
import signal
from collections.abc import Callable
from typing import Any

import torch

from remat.base.settings import one_line

__all__ = ["side_by_side"]


def side_by_side(calls: list[Callable[[], Any]]) -> list[Any]:
    """Each call's result, in order. The calls after the first run in forked children while the first runs here,
    where the system forks and has a core for each; elsewhere one after another. A child computes with one torch
    thread (an OpenMP pool that ran before the fork would hang in it) and sends its result back pickled; an error
    in a child is raised here (as a RuntimeError of its line where it does not pickle)."""
    if len(calls) < 2 or not hasattr(os, "fork") or (os.cpu_count() or 1) < len(calls):
        return [call() for call in calls]
    children = [_start(call) for call in calls[1:]]
    try:
        first = calls[0]()
    except BaseException:  # an error or an interrupt here: the children's answers are not wanted
        for pid, fd in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(fd)
        raise
    return [first, *(_finish(pid, fd) for pid, fd in children)]


def _start(call: Callable[[], Any]) -> tuple[int, int]:
    read, write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write)
        return pid, read
    os.close(read)
    try:  # the child: never returns into the parent's code
        torch.set_num_threads(1)
        try:
            out: tuple[bool, Any] = (True, call())
        except Exception as e:  # noqa: BLE001 - any error is the parent's to raise
            out = (False, e)
        try:
            data = pickle.dumps(out)
        except Exception as e:  # noqa: BLE001 - an answer or error that does not pickle
            data = pickle.dumps((False, RuntimeError(one_line(e if out[0] else out[1]))))
        with os.fdopen(write, "wb") as f:
            f.write(data)
    finally:
        os._exit(0)


def _finish(pid: int, fd: int) -> Any:
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        raise RuntimeError(f"a child process ended without its answer (wait status {status})")
    ok, value = pickle.loads(data)
    if not ok:
        raise value
    return value
