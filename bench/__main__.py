"""``python3 -m bench``: run every benchmark (see bench/run_all.py)."""
import sys

from bench.run_all import main

sys.exit(main())
