"""``python -m rlkernel``: the ``rlkernel`` command (demo | bench | consistency), as the console script."""

import sys

from rlkernel.cli import main

if __name__ == "__main__":
    sys.exit(main())
