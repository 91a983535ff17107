"""The step-time lower bound (pipeline/solvers/step_bound.py) against brute force: on
small random plans with compute, fusion and redistributions on several streams, the
bound never exceeds the smallest simulated step (pipeline/costmodel/steptime.py) over
every labelling."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from pipeline.costmodel.steptime import StepInputs, simulate
from pipeline.solvers.mrf import MRF, PairwiseFactor
from pipeline.solvers.registry import get_solver
from pipeline.solvers.step_bound import step_lower_bound


class _Instance:
    """A random plan space: ``n`` nodes (params, an input, forward and backward kernels,
    a gradient and a loss sink), ``K`` labels each; per node a compute per label, per
    edge a redistribution time, a mesh dim (one of ``D``) and a fusion term (<= 0) per
    label pair. One group per node, so the MRF's edges are the graph's."""

    def __init__(self, rng: np.random.Generator, num_dims: int):
        self.D = num_dims
        kinds = ["param", "param", "input"] + ["fwd"] * int(rng.integers(2, 4)) \
            + ["bwd"] * int(rng.integers(2, 4)) + ["grad", "loss"]
        n = self.n = len(kinds)
        self.K = [int(rng.integers(2, 4)) if k not in ("grad", "loss") else 1 for k in kinds]
        layers = [None, "layers.0", "layers.1"]
        self.g = dict(
            names=[f"n{v}" for v in range(n)],
            phase=["bwd" if k in ("bwd", "grad", "loss") else "fwd" for k in kinds],
            layer=[layers[int(rng.integers(0, 3))] for _ in kinds],
            role=[{"param": "param", "input": "input", "grad": "grad", "loss": "loss"}
                  .get(k, "activation") for k in kinds],
            placeholder=[k in ("param", "input") for k in kinds],
            sink=[k in ("grad", "loss") for k in kinds],
            weight_derived=[False] * n)
        kernels = [v for v, k in enumerate(kinds) if k in ("fwd", "bwd")]
        self.compute = [rng.uniform(0, 20, self.K[v]) if v in kernels else np.zeros(self.K[v])
                        for v in range(n)]
        edges = set()
        for v in kernels:  # every kernel reads one to two earlier nodes
            for u in rng.choice(v, size=min(v, int(rng.integers(1, 3))), replace=False):
                edges.add((int(u), v))
        edges.add((kernels[-1], n - 1))  # the loss
        bwd = [v for v in kernels if kinds[v] == "bwd"]
        edges.add((bwd[int(rng.integers(0, len(bwd)))], n - 2))  # a parameter gradient
        self.edges = sorted(edges)
        self.comm, self.dim, self.fusion = [], [], []
        for u, v in self.edges:
            shape = (self.K[u], self.K[v])
            c = rng.uniform(0, 30, shape) * (rng.random(shape) < 0.6)
            self.comm.append(c)
            self.dim.append(rng.integers(0, num_dims, shape))
            f = -rng.uniform(0, 8, shape) * (rng.random(shape) < 0.3) * (c == 0)
            self.fusion.append(f)

    def simulate(self, x: tuple[int, ...]) -> float:
        fus = np.zeros(self.n)
        for e, (u, v) in enumerate(self.edges):
            fus[v] += self.fusion[e][x[u], x[v]]
        steps = [[(int(d[x[u], x[v]]), float(c[x[u], x[v]]))] if c[x[u], x[v]] > 0 else []
                 for (u, v), c, d in zip(self.edges, self.comm, self.dim)]
        g = StepInputs(**self.g, compute_us=[max(0.0, float(self.compute[v][x[v]]) + fus[v])
                                             for v in range(self.n)],
                       edges=self.edges, steps=steps, num_dims=self.D)
        return simulate(g).step_time_us

    def build(self, theta: float, comm_coef: float) -> MRF:
        factors = [PairwiseFactor(np.arange(self.K[u], dtype=np.int32),
                                  np.arange(self.K[v], dtype=np.int32),
                                  theta * f + comm_coef * c)
                   for (u, v), f, c in zip(self.edges, self.fusion, self.comm)]
        return MRF(domain_sizes=np.array(self.K, dtype=np.int64),
                   unary=[theta * c for c in self.compute],
                   edges=np.array(self.edges, dtype=np.int64), factor=factors.__getitem__)

    def measure(self, x: np.ndarray) -> tuple[float, float]:
        compute = sum(float(self.compute[v][x[v]]) for v in range(self.n))
        compute += sum(float(f[x[u], x[v]]) for (u, v), f in zip(self.edges, self.fusion))
        comm = sum(float(c[x[u], x[v]]) for (u, v), c in zip(self.edges, self.comm))
        return compute, comm


@pytest.mark.parametrize("seed", range(12))
def test_bound_never_above_brute_force_minimum(seed):
    rng = np.random.default_rng(seed)
    inst = _Instance(rng, num_dims=int(rng.integers(1, 4)))
    trws = get_solver("approx")
    bound = step_lower_bound(inst.build, inst.measure, trws.solve, inst.D)
    steps = {x: inst.simulate(x) for x in itertools.product(*(range(k) for k in inst.K))}
    best = min(steps.values())
    assert bound.lower_bound_us <= best + 1e-9 * max(1.0, best)
    # the argument itself, plan by plan: step >= max(C, M / D)
    for x, step in steps.items():
        c, m = inst.measure(np.array(x))
        assert step >= max(c, m / inst.D) - 1e-9


def test_bound_exact_for_a_compute_bound_problem():
    # no communication and no fusion: every step is its compute stream's busy time, and
    # the bound (the cheapest compute, exact by enumeration, at theta = 1) is the
    # minimum step itself
    rng = np.random.default_rng(7)
    inst = _Instance(rng, num_dims=2)
    inst.comm = [np.zeros_like(c) for c in inst.comm]
    inst.fusion = [np.zeros_like(f) for f in inst.fusion]
    bound = step_lower_bound(inst.build, inst.measure, get_solver("brute_force").solve, inst.D)
    best = min(inst.simulate(x) for x in itertools.product(*(range(k) for k in inst.K)))
    assert bound.theta == 1.0 and len(bound.history) == 1
    assert math.isclose(bound.lower_bound_us, best, rel_tol=1e-12)
