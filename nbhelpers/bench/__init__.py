"""Benchmarks and reports: the measurements behind the phase 1 and phase 3 notebooks.

``rollout`` (the phase 1 harness: one backend per process through ``worker``, sidecars, tables),
``flex_sweep`` (flex engine points: random models, parity, timed rounds, batch sweeps),
``profile`` (kernel-class breakdown of a decode step), ``engine_report`` (the phase 3
walkthrough's tables), ``gemma4_report`` and ``gemma4_kernels`` (Gemma-4's parity, throughput and
flex_attention kernel options). Nothing heavy at import.
"""
