"""Time the MRF solvers on the step-sized synthetic instance (~3000 groups, 6000 edges,
domains of 100-300 labels: ``step_sized_mrf`` of tests/support/mrf_gen.py, seed 0).

    python benchmarks/solvers_large.py [trws] [ilp-highs] [ilp-cbc]    # default: all

``trws``: 100 TRW-S iterations without local search (wall, CPU, compile time, CPU per
iteration, bound, energy, gap), then the same with local search (energy, gap, polish
time). ``ilp-<backend>``: the exact ILP with a 120 s limit (model size, build, MPS and
backend seconds, status, objective, bound, gap). Prints one block per solver; asserts
nothing (the solvers' correctness is tested in tests/unit/test_trws.py and
test_ilp.py on instances with known optima).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHOICES = ("trws", "ilp-highs", "ilp-cbc")


def bench_trws(mrf: Any) -> str:
    """100 TRW-S iterations without, then with, local search."""
    from pipeline.solvers.trws import solve_trws

    stamps: list[float] = []
    t0, c0 = time.perf_counter(), time.process_time()
    res = solve_trws(mrf, max_iters=100, tol=0.0, local_search_rounds=0,
                     progress=lambda *a: stamps.append(time.process_time()))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    per_iter = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    polished = solve_trws(mrf, max_iters=100, tol=0.0)
    return (f"TRW-S: G={mrf.num_groups} E={mrf.num_edges} "
            f"sum K={int(mrf.domain_sizes.sum())} order={res.extra['order']} "
            f"levels={res.extra['levels']}\n"
            f"  100 iterations: wall {wall:.2f} s, cpu {cpu:.2f} s "
            f"(compile {res.extra['compile_seconds']:.2f} s, "
            f"{per_iter * 1e3:.1f} ms/iteration cpu)\n"
            f"  bound {res.lower_bound:.2f}  energy {res.objective:.2f}  gap {res.gap:.2e}\n"
            f"  with local search: energy {polished.objective:.2f} gap {polished.gap:.2e} "
            f"(polish {polished.extra['local_search_seconds']:.2f} s wall)")


def bench_ilp(mrf: Any, backend: str) -> str:
    """The exact ILP on ``backend`` (120 s limit), its MPS file in a temporary directory."""
    from pipeline.solvers.ilp import solve_ilp

    with tempfile.TemporaryDirectory() as tmp:
        res = solve_ilp(mrf, backend=backend, time_limit_s=120.0, mps_path=Path(tmp) / "b.mps")
    ex = res.extra
    return (f"ILP {backend}: G={mrf.num_groups} E={mrf.num_edges} vars={ex['variables']} "
            f"int={ex['integer_variables']} rows={ex['constraints']} nnz={ex['nonzeros']}\n"
            f"  build {ex['build_seconds']:.1f} s, pass {ex.get('pass_seconds', float('nan')):.1f}"
            f" s, mps {ex['mps_seconds']:.1f} s, backend {ex['backend_seconds']:.1f} s, "
            f"total {res.solve_seconds:.1f} s\n"
            f"  status {res.status} objective {res.objective:.1f} bound {res.lower_bound:.1f} "
            f"gap {ex['mip_gap']:.3g}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("solvers", nargs="*", choices=CHOICES, default=list(CHOICES),
                        help="solvers to time (default: all)")
    args = parser.parse_args(argv)
    # this checkout's pipeline, and the instance generator of its tests
    sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]
    from mrf_gen import step_sized_mrf

    t0 = time.perf_counter()
    mrf = step_sized_mrf()
    print(f"instance: {time.perf_counter() - t0:.1f} s to generate", flush=True)
    for name in args.solvers:
        out = bench_trws(mrf) if name == "trws" else bench_ilp(mrf, name.split("-", 1)[1])
        print(out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
