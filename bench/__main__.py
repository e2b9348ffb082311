"""``python3 -m bench``: the one benchmark entry point (see bench/runner.py and bench/README.md)."""
import sys

from bench.runner import main

sys.exit(main())
