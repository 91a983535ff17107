"""Layer 2, dtensor: the glue to torch.distributed.tensor (imports torch).

=================  ==================================================================
module             job
=================  ==================================================================
``placements``     the compact placement notation (``S(0)R``, ``P``) <-> DTensor objects
``cpu_kernels``    CPU kernels of the fused ops a traced graph holds, for verify
``torch_compat``   every private torch API the project uses, one accessor each, with its
                   public alternative (or why there is none) and torch 2.13 location
=================  ==================================================================
"""
