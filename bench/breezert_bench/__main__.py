"""``python -m breezert_bench``: the ``breezert-bench`` command."""

import sys

from breezert_bench.cli import main

sys.exit(main())
