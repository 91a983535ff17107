"""Predicted versus measured step time over meshes and plans: the closed loop of verify.

    python -m pipeline.verify.sweep [--out DIR] [--meshes 2,4,2x2] [--plans planner,ddp,fsdp]
        [--steps N] [--warmup W] [hydra overrides...]

For every mesh and every plan (``planner``: the solver's plan, no recipe; a recipe
name: ``recipe=<name>``), the stages run (reused when current) and
:func:`pipeline.verify.run.verify` times the applied step on gloo processes (timing
only: ``interpret=False, applied=False, measure=N``; :mod:`pipeline.verify.timing`).
Each run's ``verify.json`` is written beside its plan; the rows (mesh, plan, predicted
ms, measured median / min / max / quartiles, ratio, load average) go to
``DIR/predicted_vs_measured.json`` (atomic), which ``python -m pipeline.tools.results
loop DIR/predicted_vs_measured.json`` turns into a page.

The default model (:data:`TOY`) is a toy whose every matmul lies inside the matmul grid
``python -m pipeline.calibrate`` measures (M, N, K in [32, 512]: 8 sequences of 64
tokens, dim 128, SwiGLU hidden 384, vocab 512, head dim 64, float32 parameters, as
verify computes in float32) and the hardware is ``cpu_epyc2``, the profile calibrated on
this machine (``overlap: false``). Exit 2 with one line for a bad mesh, plan or number.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["TOY", "main", "sweep"]

#: The default model and hardware of the sweep (module docstring).
TOY: tuple[str, ...] = (
    "model=toy", "model.dim=128", "model.n_heads=2", "model.n_kv_heads=2",
    "model.multiple_of=128", "model.vocab_size=512", "model.seq_len=64",
    "model.batch_size=8", "model.param_dtype=float32", "hardware=cpu_epyc2")
OUT_FILE = "predicted_vs_measured.json"


def sweep(meshes: Sequence[str], plans: Sequence[str], overrides: Sequence[str],
          out: Path, steps: int, warmup: int) -> list[dict[str, Any]]:
    """Run every (mesh, plan) and write the rows (module docstring); returns them."""
    from pipeline.config import load_resolved
    from pipeline.core import runtime
    from pipeline.verify.run import verify

    rows = []
    for mesh in meshes:
        for plan in plans:
            extra = [f"mesh={mesh.replace('x', ',')}", f"results_dir={out}"]
            if plan != "planner":
                extra.append(f"recipe={plan}")
            cfg = load_resolved([*overrides, *extra])
            t0 = time.perf_counter()
            record = verify(cfg, interpret=False, applied=False, measure=steps, warmup=warmup)
            t = record.get("timing", {})
            row = {"mesh": mesh, "plan": plan, "verify": record["path"],
                   "seconds": time.perf_counter() - t0,
                   **{k: t.get(k) for k in ("predicted_ms", "median_ms", "min_ms", "max_ms",
                                            "q1_ms", "q3_ms", "ratio", "cpu_median_ms",
                                            "steps", "warmup", "hardware", "overlap",
                                            "load_average", "error")}}
            rows.append(row)
            print(f"sweep: mesh {mesh} {plan}: predicted {row['predicted_ms']} ms, measured "
                  f"{row['median_ms']} ms (load {t.get('load_average', {}).get('before')})",
                  file=sys.stderr)
    runtime.write_json(Path(out) / OUT_FILE, {
        "overrides": list(overrides), "meshes": list(meshes), "plans": list(plans),
        "steps": steps, "warmup": warmup, "environment": runtime.environment(),
        "git": runtime.git_revision(), "rows": rows})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; 2 with one line on stderr for bad input."""
    from pipeline.config import ConfigError
    from pipeline.core.errors import PlanError
    from pipeline.core.recipes import RECIPES

    p = argparse.ArgumentParser(prog="python -m pipeline.verify.sweep",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/loop"))
    p.add_argument("--meshes", default="2,4,2x2")
    p.add_argument("--plans", default="planner,ddp,fsdp")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    args, overrides = p.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    meshes = args.meshes.split(",")
    plans = args.plans.split(",")
    for m in meshes:
        if not all(x.isdigit() and int(x) >= 1 for x in m.split("x")):
            print(f"--meshes: {m!r}: allowed sizes like 4 or 2x2", file=sys.stderr)
            return 2
    for name in plans:
        if name != "planner" and name not in RECIPES:
            print(f"--plans: {name!r}: allowed planner, " + ", ".join(RECIPES), file=sys.stderr)
            return 2
    if args.steps < 1 or args.warmup < 0:
        print(f"--steps={args.steps} --warmup={args.warmup}: allowed steps >= 1, warmup >= 0",
              file=sys.stderr)
        return 2
    try:
        sweep(meshes, plans, overrides or list(TOY), args.out, args.steps, args.warmup)
    except (ConfigError, PlanError) as err:
        print(str(err).splitlines()[0], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
