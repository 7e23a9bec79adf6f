"""`python -m gptlite.evaluate`: the command of gptlite.evaluate."""

import sys

from gptlite.evaluate.command import main

sys.exit(main())
