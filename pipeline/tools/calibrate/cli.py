"""``python -m pipeline.calibrate``: measure this machine into a hardware profile.

    python -m pipeline.calibrate [--name NAME] [--out DIR] [--quick] [--device cpu|cuda]
                                 [--backend gloo|nccl] [--ranks 2,4] [--no-collectives]
                                 [--threads 1]
    python -m pipeline.calibrate import-nccl-tests FILE --profile PROFILE.yaml
                                 --kind all_gather --per-node 8 --nodes 2 [--backend nccl]
    python -m pipeline.calibrate compare A.yaml B.yaml [--above-us 1000]

The first writes ``<out>/<name>.yaml`` (default ``conf/hardware/<name>.yaml``: then
``hardware=<name>`` selects it). The second puts a measured nccl-tests table into a
profile's collective tables (replacing that kind and layout's table; the profile's
``tables.measured`` gains ``collectives``). The third prints the entries of two
profiles above ``--above-us`` and their relative difference (the agreement of two runs).

Bad input (one line on stderr, exit 2, nothing written): an unknown backend or device,
more ranks than the machine holds (:func:`~.collectives.max_processes`), a bad name, a
profile with a missing or negative entry, a table whose sizes are not increasing.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from pipeline.core.runtime import PROJECT_ROOT

__all__ = ["main"]

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class _Bad(ValueError):
    """Bad input: one line, exit 2."""


def _ranks(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise _Bad(f"--ranks={text!r}: allowed a comma-separated list of integers >= 2") from None
    if not out or any(n < 2 for n in out):
        raise _Bad(f"--ranks={text!r}: allowed a comma-separated list of integers >= 2")
    return tuple(sorted(set(out)))


def _measure(args: argparse.Namespace) -> int:
    if not _NAME.match(args.name):
        raise _Bad(f"--name={args.name!r}: allowed letters, digits, '.', '_', '-'")
    if args.device not in ("auto", "cpu", "cuda"):
        raise _Bad(f"--device={args.device!r}: allowed auto, cpu, cuda")
    if args.backend not in ("auto", "gloo", "nccl"):
        raise _Bad(f"--backend={args.backend!r}: allowed auto, gloo, nccl")
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise _Bad("--device=cuda: no CUDA device on this machine; allowed cpu")
    backend = args.backend if args.backend != "auto" else ("nccl" if device == "cuda"
                                                            else "gloo")
    if backend == "nccl" and device != "cuda":
        raise _Bad(f"--backend=nccl with --device={device}: NCCL needs CUDA; allowed gloo")
    from pipeline.tools.calibrate.collectives import max_processes

    cap = max_processes(backend)
    if args.no_collectives:
        ranks: tuple[int, ...] = ()
    elif args.ranks is None:
        ranks = tuple(n for n in ((2,) if args.quick else (2, 4)) if n <= cap)
    else:
        ranks = _ranks(args.ranks)
        if max(ranks) > cap:
            raise _Bad(f"--ranks={args.ranks}: this machine holds at most {cap} {backend} "
                       "processes (gloo: two per usable CPU core and 1 GiB each; nccl: one "
                       "per GPU)")
    out = Path(args.out) / f"{args.name}.yaml"
    from pipeline.tools.calibrate.run import calibrate, write_profile

    if args.threads < 1:
        raise _Bad(f"--threads={args.threads}: allowed an integer >= 1")
    hw = calibrate(args.name, device, backend, ranks, args.quick, args.threads)
    write_profile(hw, out)
    print(f"wrote {out}")
    return 0


def _load(path: str) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise _Bad(f"profile {path!r}: no such file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        raise _Bad(f"profile {path!r}: not YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise _Bad(f"profile {path!r}: not a mapping")
    _check(data, path)
    return data


def _check(data: dict, path: str) -> None:
    from omegaconf import OmegaConf

    from pipeline.costmodel.hardware import HardwareConfig

    try:
        merged = OmegaConf.merge(OmegaConf.structured(HardwareConfig), data)
        OmegaConf.to_object(merged)
    except ValueError as err:  # a TablesError or a hardware value
        raise _Bad(f"profile {path!r}: {str(err).splitlines()[0]}") from None
    except Exception as err:  # omegaconf: unknown key or a value of the wrong type
        raise _Bad(f"profile {path!r}: {str(err).splitlines()[0]}") from None


def _import(args: argparse.Namespace) -> int:
    from pipeline.tools.calibrate.collectives import KINDS
    from pipeline.tools.calibrate.nccl_tests import parse_nccl_tests
    from pipeline.tools.calibrate.run import write_profile

    if args.kind not in KINDS:
        raise _Bad(f"--kind={args.kind!r}: allowed " + ", ".join(KINDS))
    if args.backend not in ("nccl", "gloo"):
        raise _Bad(f"--backend={args.backend!r}: allowed nccl, gloo")
    if args.per_node < 1 or args.nodes < 1 or args.per_node * args.nodes < 2:
        raise _Bad(f"--per-node={args.per_node} --nodes={args.nodes}: allowed integers >= 1 "
                   "making a group of at least 2 ranks")
    src = Path(args.file)
    if not src.is_file():
        raise _Bad(f"{args.file!r}: no such file")
    try:
        rows = parse_nccl_tests(src.read_text(), args.file)
    except ValueError as err:
        raise _Bad(str(err)) from None
    data = _load(args.profile)
    tables = data.get("tables")
    if not isinstance(tables, dict):
        raise _Bad(f"profile {args.profile!r}: tables=null; import into a calibrated profile "
                   "(python -m pipeline.calibrate writes one)")
    colls = [c for c in tables.get("collectives", [])
             if (c["kind"], c["per_node"], c["nodes"]) != (args.kind, args.per_node, args.nodes)]
    colls.append({"kind": args.kind, "per_node": args.per_node, "nodes": args.nodes,
                  "backend": args.backend, "rows": rows})
    tables["collectives"] = colls
    if "collectives" not in tables["measured"]:
        tables["measured"] = [*tables["measured"], "collectives"]
    _check(data, args.file)
    write_profile(data, Path(args.profile))
    print(f"wrote {args.profile}: {args.kind} on {args.per_node} x {args.nodes}, "
          f"{len(rows)} sizes")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from pipeline.tools.calibrate.run import compare_profiles

    a, b = _load(args.a), _load(args.b)
    if not isinstance(a.get("tables"), dict) or not isinstance(b.get("tables"), dict):
        raise _Bad("compare: both profiles need tables")
    rows = compare_profiles(a, b, args.above_us)
    for key, ta, tb, rel in rows:
        print(f"{rel * 100:6.1f} %  {ta:12.1f} {tb:12.1f} us  {key}")
    worst = rows[0][3] * 100 if rows else 0.0
    print(f"{len(rows)} entries above {args.above_us:g} us; largest difference {worst:.1f} %")
    return 0


def _parser(argv: list[str]) -> tuple[argparse.ArgumentParser, str]:
    sub = argv[0] if argv and argv[0] in ("import-nccl-tests", "compare") else "measure"
    p = argparse.ArgumentParser(prog="python -m pipeline.calibrate",
                                description=__doc__.split("\n\n")[0])
    if sub == "measure":
        p.add_argument("--name", default="local")
        p.add_argument("--out", default=str(PROJECT_ROOT / "conf" / "hardware"))
        p.add_argument("--quick", action="store_true")
        p.add_argument("--device", default="auto")
        p.add_argument("--backend", default="auto")
        p.add_argument("--ranks", default=None)
        p.add_argument("--no-collectives", action="store_true")
        p.add_argument("--threads", type=int, default=1)
    elif sub == "import-nccl-tests":
        p.add_argument("file")
        p.add_argument("--profile", required=True)
        p.add_argument("--kind", required=True)
        p.add_argument("--per-node", type=int, required=True)
        p.add_argument("--nodes", type=int, required=True)
        p.add_argument("--backend", default="nccl")
    else:
        p.add_argument("a")
        p.add_argument("b")
        p.add_argument("--above-us", type=float, default=1000.0)
    return p, sub


def main(argv: list[str] | None = None) -> int:
    """Run the command; 2 with one line on stderr for bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, sub = _parser(argv)
    args = parser.parse_args(argv[1:] if sub != "measure" else argv)
    try:
        return {"measure": _measure, "import-nccl-tests": _import, "compare": _compare}[sub](args)
    except _Bad as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
