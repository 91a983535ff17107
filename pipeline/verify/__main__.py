"""``python -m pipeline.verify``: see :mod:`pipeline.verify.run`."""

import sys

from pipeline.verify.run import main

if __name__ == "__main__":
    sys.exit(main())
