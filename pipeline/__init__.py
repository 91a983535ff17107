"""Sharding-placement search for PyTorch training steps on a device mesh.

Stages (one module each): trace -> topology -> costs -> solve -> report.
"""

import time as _time

#: perf_counter() when the package was first imported (process wall-clock origin).
PROCESS_START = _time.perf_counter()
