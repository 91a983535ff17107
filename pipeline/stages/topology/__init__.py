"""Stage 2 - topology: strategies, edges, groups and pins from the graph IR.

For every node of the traced joint graph this stage enumerates its DTensor
sharding strategies on the N-D mesh, records the producer -> consumer edges,
groups nodes that are decided jointly, and applies the placement constraints
(pins). Nothing here builds a solver model; the cost stage turns the result into
an MRF.

One job per module:

====================  ======================================================================
module                job
====================  ======================================================================
``candidates``        :class:`StrategyList`; the shardable placements of one tensor
``strategies``        DTensor strategy enumeration per node signature, rejections counted
``extra_strategies``  strategies DTensor lacks: context-parallel attention, vocab-parallel
                      cross-entropy
``portable``          strategy lists on their way back from a worker process
``problem``           the problem nodes (graph nodes and output sinks), strategy lists
                      shared between them, edges
``groups``            fwd/bwd twins and the copies of repeated layers (structural hash)
``pins``              ``constraints.inputs`` / ``outputs`` / ``nodes`` applied to groups
``recipe_pins``       a recipe's pins: parameters, residual stream, and per mesh dim every
                      node the textbook plan fixes (module roles, propagation, anchors)
``recipe_domains``    a planner run's recipes as restrictions of its domains (the solve
                      stage's recipe candidates)
``artifacts``         ``nodes.parquet``, ``strategies.parquet``, ``edges.parquet``,
                      ``topology.json``: written and read back
``stage``             :func:`build_topology` (the steps in order) and :func:`run_topology`
====================  ======================================================================

The graph IR (``graph.parquet`` read back as :class:`IRNode`\\ s, and its JSON conventions)
is :mod:`pipeline.core.ir`.
"""

from pipeline.core.ir import IRNode, load_nodes, read_nodes
from pipeline.stages.topology.artifacts import (
    EDGES_FILE,
    NODES_FILE,
    STRATEGIES_FILE,
    TOPOLOGY_FILE,
    TopologyTables,
    read_topology,
    write_topology,
)
from pipeline.stages.topology.candidates import StrategyList, candidate_placements, shardable
from pipeline.stages.topology.groups import repeated_layers, structural_hashes
from pipeline.stages.topology.pins import find_logits
from pipeline.stages.topology.problem import ProblemNode, StrategyTable, Topology, TopologyError
from pipeline.stages.topology.stage import build_topology, device_mesh, run_topology
from pipeline.stages.topology.strategies import StrategyEnumerator

__all__ = [
    "EDGES_FILE",
    "NODES_FILE",
    "STRATEGIES_FILE",
    "TOPOLOGY_FILE",
    "IRNode",
    "ProblemNode",
    "StrategyEnumerator",
    "StrategyList",
    "StrategyTable",
    "Topology",
    "TopologyError",
    "TopologyTables",
    "build_topology",
    "candidate_placements",
    "device_mesh",
    "find_logits",
    "load_nodes",
    "read_nodes",
    "read_topology",
    "repeated_layers",
    "run_topology",
    "shardable",
    "structural_hashes",
    "write_topology",
]
