"""``python -m pipeline.calibrate``: measure this machine into a hardware profile
(:mod:`pipeline.tools.calibrate.cli`; docs/cost-model.md, "Calibration")."""

import sys

from pipeline.tools.calibrate.cli import main

if __name__ == "__main__":
    sys.exit(main())
