"""``python -m pipeline.cli <stage> [hydra overrides...]``: run one stage (a Snakemake job).

The work is in :mod:`pipeline.stages.runner`; this module is the command's name.
"""

import sys

from pipeline.stages.runner import main

if __name__ == "__main__":
    sys.exit(main())
