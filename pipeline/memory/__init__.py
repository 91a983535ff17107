"""Per-device memory of a plan, in bytes: what FSDP2 / torchtitan hold on one GPU.

The model (each part in its module):

* **parameters** in their storage dtype (the traced placeholders: float32 here) at
  their local size under the chosen placement; **gradients** in the dtype the traced
  step reduces them in (``model.reduce_dtype``, cast in the graph as FSDP2's
  ``MixedPrecisionPolicy.reduce_dtype``) at the parameter's placement (the gradient
  sink is tied to it); **optimizer state** per the ``optimizer/`` group (AdamW: two
  float32 moments per parameter element, sharded like the parameter, as
  ``torch.optim.AdamW`` on FSDP2's sharded DTensor parameters; SGD: one momentum buffer
  when ``momentum > 0``, else none; ``none``: nothing): :mod:`.terms`;
* **saved activations**: every forward value a backward node reads
  (``torch.autograd`` keeps exactly the tensors its derivative formulas name; the
  joint graph's backward reads those), one storage per alias class, at its local size
  under the chosen placement: :mod:`.graph`, :mod:`.terms`;
* **gathered weights**: the compute-dtype copies of weights the backward reads. With
  ``fsdp.reshard_after_forward=true`` (FSDP2's default) the unsharded weight is freed
  after forward and all-gathered again in backward (a transient of that module's
  backward; the all-gather is paid a second time,
  :meth:`.graph.StepGraph.backward_weight_reads` names those edges), with ``false`` it
  lives until its last backward use;
* **activation checkpointing** ``memory.activation_checkpointing``: ``full`` keeps only
  each repeated layer's input and recomputes the rest of the layer before its backward
  (one more forward of the layer in compute time), ``selective`` is torchtitan's
  op-level policy: it also keeps the outputs of attention and of every other matmul
  (``selective_all_matmuls``: of every matmul); :mod:`.graph` states the rules;
* the **peak**: a liveness walk in graph order (forward, then backward) with the
  redistributed inputs, re-gathered weights, recomputed values and unreduced gradients
  as transients: :mod:`.liveness`.

Parameters, gradients, optimizer state, buffers, saved activations and (without
resharding) gathered weights are each a function of one node's strategy, so their sum
is a linear row over the group labels (``constraints.device_memory``); the walk is the
exact check of a chosen plan, and the difference between the two is reported.

Sources: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``: sharded parameters as
DTensors, ``reshard_after_forward``, ``MixedPrecisionPolicy``), torchtitan's memory
estimation and activation-checkpointing options (``full``, ``selective`` op / layer),
Rajbhandari et al. 2020 (ZeRO: 2 + 2 + 12 bytes per parameter for mixed-precision Adam,
here 4 + 4 + 8 with float32 master parameters and gradients), Korthikanti et al. 2022
(activation memory per layer and selective recomputation of the attention core).

This package imports none of its modules (the config schema reads :mod:`.options`
without paying for torch); import what you use from its module:

=================  ==================================================================
module             job
=================  ==================================================================
``options``        what the model is told about the step (optimizer, checkpointing,
                   FSDP), their config schemas and checks, byte-size parsing
``graph``          static facts of the traced graph: storages, saved values, layers
                   (:class:`~.graph.StepGraph`, :func:`~.graph.step_graph`)
``terms``          the linear part: bytes per device of each node under each strategy
                   (:class:`~.terms.LinearTerms`, :func:`~.terms.linear_terms`)
``liveness``       the liveness walk of one plan and its peak (:func:`~.liveness.walk`)
``model``          the bundle the costs and solve stages use (:func:`~.model.memory_model`)
``constraint``     ``constraints.device_memory``: the MRF's memory rows, the plan check
``budget``         the parameter-memory budget row
``record``         the memory facts of a solved plan for the run record
=================  ==================================================================
"""
