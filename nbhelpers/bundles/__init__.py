"""Offline wheel sets for GPU hosts with no network: ``python -m nbhelpers.bundles``.

``sets`` (what each set holds and what the H200 image already has), ``build`` (download, trim,
split into carry-sized parts, resplit, the CLI), ``verify`` (metadata closure and imports).
"""
