"""``python -m rlkernel.bench ...``: the same as ``rlkernel bench ...``."""

import sys

from rlkernel.bench.cli import main

sys.exit(main())
