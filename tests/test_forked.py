"""`core.forked.side_by_side`: calls in forked children, results and errors back in the parent, in order."""

from __future__ import annotations

import os
import threading
import time

import pytest

from remat.base.settings import UsageError
from remat.core.forked import side_by_side


def test_results_come_back_in_order_from_another_process():
    here = os.getpid()
    assert side_by_side([os.getpid, os.getpid])[0] == here
    assert side_by_side([os.getpid, os.getpid])[1] != here  # the suite's machines have the two cores it needs
    assert side_by_side([lambda: ("window", 1), lambda: ("walk", [1, 2])]) == [("window", 1), ("walk", [1, 2])]
    assert side_by_side([os.getpid]) == [here]


def test_a_childs_error_is_raised_here():
    def refuse():
        raise UsageError("--ubatch 7 is not a multiple of 8")
    with pytest.raises(UsageError, match="not a multiple of 8"):
        side_by_side([lambda: 1, refuse])


def test_an_answer_that_does_not_pickle_is_an_error_naming_it():
    with pytest.raises(RuntimeError, match="pickle"):
        side_by_side([lambda: 1, threading.Lock])


def test_an_error_here_stops_the_children():
    def refuse():
        raise UsageError("no budget")

    started = time.monotonic()
    with pytest.raises(UsageError, match="no budget"):
        side_by_side([refuse, lambda: time.sleep(60)])
    assert time.monotonic() - started < 30  # the child was stopped, not waited for
