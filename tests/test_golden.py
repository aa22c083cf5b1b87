"""Behaviour held byte for byte to `golden/golden.json`, written by the code before the gate moved into one
place (cfb8472): every plan category of a few models, policies and paths, the gate's answers (a budget between
rungs, a refusal), one rank's plan of two, short training runs' losses, and the demo's first losses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).with_name("golden")))

import answers
import cases

GOLDEN = json.loads(Path(__file__).with_name("golden").joinpath("golden.json").read_text())

pytestmark = pytest.mark.usefixtures("one_thread")


def test_plans_are_the_golden_ones():
    assert answers.plans() == GOLDEN["plans"]


def test_one_ranks_plan_is_the_golden_one():
    assert answers.world() == GOLDEN["world"]


def test_the_gates_answers_are_the_golden_ones():
    assert answers.choices() == GOLDEN["choices"]


def test_training_losses_are_the_golden_ones():
    assert answers.train(cases.TRAIN) == GOLDEN["train"]


def test_the_demos_first_losses_are_the_golden_ones():
    """`make demo`'s first three steps (the default model, its corpus, every default): the same losses to the bit,
    the same policy and plans, but for what holding the GGUF's blocks changed (quant): `frozen` (the blocks, not
    float32 copies), `graph` and `step` (a layer's weights made float while it computes)."""
    demo = answers.train([("demo", {"steps": 3})])["demo"]
    assert demo["losses"] == GOLDEN["demo"]["losses"][:3]
    assert demo["policy"] == GOLDEN["demo"]["policy"]
    as_stored = ("frozen", "graph", "step")
    for name, plan in GOLDEN["demo"]["plans"].items():
        assert {k: v for k, v in demo["plans"][name].items() if k not in as_stored} == \
            {k: v for k, v in plan.items() if k not in as_stored}
        assert demo["plans"][name]["frozen"] < plan["frozen"] / 5
