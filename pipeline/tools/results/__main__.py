"""``python -m pipeline.tools.results``: :func:`pipeline.tools.results.cli.main`."""

import sys

from pipeline.tools.results.cli import main

sys.exit(main())
