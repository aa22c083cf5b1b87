"""`python -m remat ...`: the command line, also as torchrun's module (`torchrun ... -m remat finetune ...`)."""

import sys

from remat.cli import main

sys.exit(main())
