"""``python -m pipeline.tools.paper``: see :mod:`pipeline.tools.paper`."""

import sys

from pipeline.tools.paper.cli import main

sys.exit(main())
