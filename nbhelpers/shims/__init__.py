"""Upstream quirks, one per file (DESIGN.md rule 7).

Each module's docstring gives why, the affected versions, a link and its removal condition; each
is applied explicitly by the code that needs it (nothing is patched at import of this package).
"""
