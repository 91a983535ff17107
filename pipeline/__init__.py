"""Sharding-placement search for PyTorch training steps on a device mesh.

Stages (one package each): trace -> topology -> costs -> solve -> report.

The package is built in layers (:data:`LAYERS`, checked by ``tests/test_layering.py``): a
module imports only from its own layer or lower ones, and this root module from none.
"""

import time as _time

#: The layers of the package, lowest first. Each layer is a tuple of *lanes* that are
#: independent of one another (no module of one lane imports a module of another lane of
#: the same layer); a lane is a tuple of *units*, lowest first, each a subpackage or
#: module name relative to ``pipeline`` (a module belongs to the unit that is the longest
#: prefix of its name). A module in unit ``u`` may import a module in unit ``v`` when
#: ``v`` is in a lower layer, or in the same lane as ``u`` and not above it.
#:
#: core < {dtensor, solvers} < {models, memory < costmodel} < plan < config
#: < stages (trace < topology < costs < solve < report < runner)
#: < {apply < verify, tools} < {api, cli, __main__, calibrate}
#:
#: (verify executes a plan with apply's graph interpreter, hence apply < verify.)
LAYERS: tuple[tuple[tuple[str, ...], ...], ...] = (
    (("core",),),
    (("dtensor",), ("solvers",)),
    (("models",), ("memory", "costmodel")),
    (("plan",),),
    (("config",),),
    (("stages", "stages.trace", "stages.topology", "stages.costs", "stages.solve",
      "stages.report", "stages.runner"),),
    (("apply", "verify"), ("tools",)),
    (("api",), ("cli",), ("__main__",), ("calibrate",)),
)

#: perf_counter() when the package was first imported (process wall-clock origin).
PROCESS_START = _time.perf_counter()
