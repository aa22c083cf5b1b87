"""Write golden.json (see cases.py) with the code of today: run only when an answer changed on purpose, and say
why in the commit. The first golden.json was written at cfb8472, before the gate moved into one place.

The "demo" entry is the receipt of `make demo` (`remat finetune --out out/demo --json`: every loss, the policy,
the plans less runtime and trace); it is kept as it is unless `--demo` runs the whole demo again (two minutes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

import answers  # noqa: E402
import cases  # noqa: E402

GOLDEN = Path(__file__).with_name("golden.json")


def main() -> None:
    old = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    out = {"plans": answers.plans(), "world": answers.world(), "choices": answers.choices(),
           "train": answers.train(cases.TRAIN), "demo": old.get("demo")}
    if "--demo" in sys.argv or out["demo"] is None:
        out["demo"] = answers.train([("demo", {"out": None})])["demo"]
    GOLDEN.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
