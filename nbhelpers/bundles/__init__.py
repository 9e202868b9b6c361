"""Offline wheel sets for GPU hosts with no network: ``python -m nbhelpers.bundles``.

``sets`` (what each set holds and what the H200 image already has), ``build`` (download, trim,
pack, resplit), ``parts`` (split / join / pack / hash), ``cli`` (the commands),
``verify`` (metadata closure and imports).
"""
