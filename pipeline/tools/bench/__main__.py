"""``python -m pipeline.tools.bench``: :func:`pipeline.tools.bench.cli.main`."""

import sys

from pipeline.tools.bench.cli import main

sys.exit(main())
