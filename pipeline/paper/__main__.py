"""``python -m pipeline.paper``: see :mod:`pipeline.paper`."""

import sys

from pipeline.paper.cli import main

sys.exit(main())
