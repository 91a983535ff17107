"""Print where a test run's background jobs spent their time: ``python
tests/support/jobs_summary.py <jobs log> [N]`` (the log of
:data:`fixtures.JOBS_LOG_ENV`; ``.ci/run`` prints it after pytest's ``--durations``).
The jobs run beside the tests (toy runs, the model jobs, modules' own subprocesses), so
pytest's durations show only the part a test waited for."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    path = Path(argv[0])
    top = int(argv[1]) if len(argv) > 1 else 15
    if not path.is_file():
        print(f"background jobs: no log at {path}")
        return 0
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    cpu = [r["cpu_s"] for r in rows if r.get("cpu_s") is not None]
    print(f"background jobs: {len(rows)}, {sum(r['seconds'] for r in rows):.0f} s of wall "
          f"in all; CPU {sum(cpu):.0f} s over the {len(cpu)} that measure it")
    for r in sorted(rows, key=lambda r: -r["seconds"])[:top]:
        c = "" if r.get("cpu_s") is None else f" (CPU {r['cpu_s']:.1f} s)"
        print(f"{r['seconds']:8.1f}s {r['worker'] or '-':>4} {r['key'][-110:]}{c}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
