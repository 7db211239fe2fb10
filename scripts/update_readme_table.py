"""Rewrite README.md's benchmark table from the committed CSVs: same as ``rlkernel bench --readme``.

Usage: python scripts/update_readme_table.py [--results benchmarks/results] [--readme-path README.md]
(with the package installed, or PYTHONPATH=src).
"""

import sys

from rlkernel.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["--readme", *sys.argv[1:]]))
