"""Stage 1 - trace: the model's joint forward + loss + backward graph as ``graph.parquet``.

=========  =======================================================================
module     job
=========  =======================================================================
``stage``  capture under a fake process group on meta tensors, encode the graph IR
``stamp``  trace 4 identical blocks and stamp the middle one to the model's depth
=========  =======================================================================
"""
