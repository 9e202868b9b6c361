"""Upstream quirks, one per file (DESIGN.md rule 7): why, affected versions, link, removal condition.

- ``transformers_top_k``: vLLM's ``top_k=-1`` ("off") for transformers ``generate`` (TRL 1.15.0).
"""
