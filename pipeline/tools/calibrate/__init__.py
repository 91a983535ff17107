"""Calibration: measure the machine into a hardware profile (``python -m
pipeline.calibrate``; :mod:`.cli`). :mod:`.measure` times kernels on one device,
:mod:`.collectives` times collectives on spawned processes, :mod:`.nccl_tests` reads an
nccl-tests output, :mod:`.run` composes the profile (format: pipeline/costmodel/profile.py).
"""
