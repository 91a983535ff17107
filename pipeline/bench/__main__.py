"""``python -m pipeline.bench``: :func:`pipeline.bench.cli.main`."""

import sys

from pipeline.bench.cli import main

sys.exit(main())
