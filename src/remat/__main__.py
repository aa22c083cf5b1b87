"""`python -m remat ...`: the command line, also as torchrun's module (`torchrun ... -m remat finetune ...`)."""

from remat.cli import run

run()
