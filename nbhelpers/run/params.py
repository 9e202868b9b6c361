"""Notebook parameters for the runner: read ``-p`` values and configs, check them against the
notebook's ``parameters`` cell before anything is launched or any output name is claimed.

Contract: :func:`notebook_parameters` parses the cell tagged ``parameters`` with :mod:`ast`
(``name: type = default`` or ``name = default``; papermill's own inspector skips any line with
two ``=``) and returns ``{name: annotation or None}``. :func:`check_parameters` raises
:class:`UserInputError` for an unknown name (listing the valid ones, with a ``difflib`` close
match) or a value whose type does not match the annotation (``int``, ``float``, ``bool``, ``str``,
``list``, ``tuple``, ``dict``; ``X | None`` / ``Optional[X]`` also accept ``None``; an int is fine
for a ``float``; other annotations are not checked). :func:`parse_overrides` reads each ``-p``
VALUE as a YAML literal and names the ``-p`` whose value does not parse. :func:`plan_parameters`
loads ``configs/<stem>.<profile>.yaml`` for every notebook of a run and checks all of them (the
runner calls it before claiming any output name); the value checks are
:func:`nbhelpers.run.values.check_values` (config dataclass fields, counts, names).
"""

from __future__ import annotations

import ast
import difflib
import logging
import re
from pathlib import Path
from typing import Any

from nbhelpers.run.errors import MissingInputError, UserInputError
from nbhelpers.run.values import check_values

__all__ = ["MissingInputError", "UserInputError", "check_parameters", "check_value",
           "load_parameters", "notebook_parameters", "parse_overrides", "plan_parameters",
           "profiles"]

log = logging.getLogger("nbhelpers.run.runner")

RUNNER_PARAMETERS = ("sidecar_path",)
"""Set by the runner itself: the notebook may or may not declare them."""


_CHECKS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "list": lambda v: isinstance(v, list),
    "tuple": lambda v: isinstance(v, (list, tuple)),  # YAML has no tuples
    "dict": lambda v: isinstance(v, dict),
}


def _parameters_source(notebook: Path) -> str | None:
    """The source of ``notebook``'s cell tagged ``parameters`` (``None`` without one), read as
    JSON with the standard library (nbformat 4 stores cells as JSON: ``source`` a string or a
    list of lines), so the checks run where nbformat is not installed (the H200 image).

    Raises:
        UserInputError: the file is not a readable notebook (names the file and the fix).
    """
    import json
    try:
        cells = json.loads(Path(notebook).read_text(encoding="utf-8"))["cells"]
        for cell in cells:
            if "parameters" in (cell.get("metadata") or {}).get("tags", []):
                src = cell.get("source", "")
                return src if isinstance(src, str) else "".join(src)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserInputError(f"{notebook}: not a readable Jupyter notebook ({type(exc).__name__}:"
                             f" {str(exc).splitlines()[0] if str(exc) else ''}); give one of the "
                             "notebooks/<phase>/*.ipynb files.") from exc
    return None


def notebook_parameters(notebook: Path) -> dict[str, str | None] | None:
    """``{name: annotation source or None}`` of ``notebook``'s ``parameters`` cell, in order;
    ``None`` when the notebook has no such cell.

    Raises:
        UserInputError: the cell is not valid Python (the message names the notebook and line).
    """
    src = _parameters_source(notebook)
    if src is None:
        return None
    try:
        tree = ast.parse(src)
    except SyntaxError as exc:
        raise UserInputError(f"{notebook.name}: parameters cell line {exc.lineno} is not valid "
                             f"Python ({exc.msg}): fix the notebook.") from exc
    out: dict[str, str | None] = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = ast.unparse(node.annotation)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = None
    return out


def _type_names(annotation: str) -> tuple[set[str], bool] | None:
    """Base type names of ``annotation`` and whether ``None`` is allowed; ``None`` if unchecked."""
    ann = annotation.replace("typing.", "").replace(" ", "")
    if ann.startswith("Optional[") and ann.endswith("]"):
        ann = ann[len("Optional["):-1] + "|None"
    names, nullable = set(), False
    for part in ann.split("|"):
        base = part.split("[", 1)[0]
        if base == "None":
            nullable = True
        elif base.lower() in _CHECKS:  # List, Dict, Tuple from typing too
            names.add(base.lower())
        else:
            return None
    return names, nullable


def check_value(name: str, annotation: str | None, value: Any, source: str) -> None:
    """Raise :class:`UserInputError` when ``value`` does not fit ``annotation`` (see module)."""
    kinds = _type_names(annotation) if annotation else None
    if kinds is None:
        return
    names, nullable = kinds
    if (value is None and nullable) or any(_CHECKS[n](value) for n in names):
        return
    hint = (f" Write a list in brackets: -p {name} '[{value}]'."
            if "list" in names and isinstance(value, (str, int, float)) and
            not isinstance(value, bool) else "")
    if "str" in names and value is None:  # `-p device ''`: an empty YAML value is null
        hint = (f" An empty value reads as null in YAML: for an empty string pass -p {name} "
                "'\"\"'.")
    if "str" in names and isinstance(value, bool):  # YAML 1.1 reads on/off/yes/no as booleans
        hint = (f" YAML reads on/off/yes/no/true/false as booleans: quote the word, e.g. -p {name} "
                f"\"'{'on' if value else 'off'}'\".")
    raise UserInputError(f"{source}: parameter {name!r} expects {annotation}, got {value!r} "
                         f"({type(value).__name__}).{hint}")


def check_parameters(notebook: Path, params: dict[str, Any], sources: dict[str, str]) -> None:
    """Check every ``params`` name and value against ``notebook``'s parameters cell.

    ``sources`` maps a name to where its value came from (``-p answer``, ``configs/x.h200.yaml``).

    Raises:
        UserInputError: unknown name (valid names and a close match listed), a value of the wrong
            type, or parameters given to a notebook without a ``parameters`` cell.
    """
    declared = notebook_parameters(notebook)
    given = [n for n in params if n not in RUNNER_PARAMETERS]
    if declared is None:
        if given:
            raise UserInputError(f"{notebook.name} has no cell tagged 'parameters', so {given} "
                                 "cannot be set: tag its parameters cell.")
        return
    for name in given:
        where = sources.get(name, "parameter")
        if name not in declared:
            raise UserInputError(f"{where}: {notebook.name} has no parameter {name!r}."
                                 f"{_valid_names(name, list(declared))}")
        check_value(name, declared[name], params[name], f"{where} ({notebook.name})")


_SCI_FLOAT = re.compile(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+")


def parse_overrides(pairs: list[tuple[str, str]] | list[list[str]] | None) -> dict[str, Any]:
    """``-p NAME VALUE`` pairs, each VALUE read as a YAML literal (``3`` -> int, ``a`` -> str;
    ``1e-5``, a string to YAML 1.1, -> float).

    Raises:
        UserInputError: a VALUE that is not valid YAML (the message names that ``-p``), or a
            NAME given twice (which one should win is the user's call, not argparse order's).
    """
    import yaml
    out: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for name, value in pairs or []:
        if name in seen:
            raise UserInputError(f"-p {name} given twice ({seen[name]!r} and {value!r}): keep "
                                 "the one you mean.")
        seen[name] = value
        try:
            out[name] = yaml.safe_load(value)
            if isinstance(out[name], str) and _SCI_FLOAT.fullmatch(value.strip()):
                out[name] = float(value)  # YAML 1.1 reads 1e-5 (no dot) as a string
        except yaml.YAMLError as exc:
            first = str(exc).splitlines()[0]
            raise UserInputError(f"-p {name} {value!r}: not a YAML literal ({first}); quote "
                                 "lists as '[a, b]' and strings with ':' as '\"a: b\"'.") from exc
    return out


def load_parameters(notebook: Path, profile: str, overrides: dict[str, Any] | None = None,
                    configs: Path | None = None) -> dict[str, Any]:
    """``configs/<stem>.<profile>.yaml`` overridden by ``overrides``.

    A missing file is fine for ``profile="cpu"`` (the notebook's defaults are CPU smoke size).

    Raises:
        MissingInputError: no config file for a non-CPU profile (a ``FileNotFoundError``).
        UserInputError: the file is not YAML, or not a mapping of names to literals.
    """
    import yaml
    configs = configs or Path(__file__).resolve().parents[2] / "configs"
    path = configs / f"{notebook.stem}.{profile}.yaml"
    params: dict[str, Any] = {}
    if path.is_file():
        try:
            params = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise UserInputError(f"{path}: not valid YAML ({str(exc).splitlines()[0]}).") from exc
        if not isinstance(params, dict):
            raise UserInputError(f"{path}: must map parameter names to literals, got "
                                 f"{type(params).__name__}.")
    elif profile != "cpu":
        raise MissingInputError(f"no {path.relative_to(configs.parent)} for profile "
                                f"{profile!r}: write it (literals only) or use --profile cpu.")
    return {**params, **(overrides or {})}


def profiles(configs: Path) -> list[str]:
    """Profiles with at least one ``configs/<stem>.<profile>.yaml``, plus ``cpu`` (defaults)."""
    return sorted({"cpu", *(p.name.split(".")[-2] for p in configs.glob("*.*.yaml"))})


def plan_parameters(notebooks: list[Path], profile: str, overrides: dict[str, Any],
                    repo: Path | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """Parameters of each notebook, all checked before any output is claimed.

    In a phase run (several notebooks) a notebook without a config for a non-CPU ``profile`` is
    skipped with a logged note while another notebook of the phase has one (``19_compare`` is
    CPU-only); a ``-p`` name is passed only to the notebooks that declare it and must be declared
    by at least one. A single notebook must have its config and declare every ``-p`` name.

    Raises:
        UserInputError: unknown profile, missing config (single notebook, or none in the phase),
            unknown parameter name, a value of the wrong type (see ``run_params``), or a ``-p``
            or config value for a runner-set parameter (``sidecar_path``; the runner sets it,
            and the valid names listed for an unknown one leave it out).
    """
    configs = (repo or Path(__file__).resolve().parents[2]) / "configs"
    _refuse_runner_parameters(overrides, "-p")
    if profile not in (known := profiles(configs)):
        raise UserInputError(f"unknown profile {profile!r}: use one of {known} "
                             "(configs/<stem>.<profile>.yaml).")
    planned = _load_all(notebooks, profile, configs)
    for nb, params in planned:
        _refuse_runner_parameters(params, f"configs/{nb.stem}.{profile}.yaml:")
    declared = {nb: notebook_parameters(nb) for nb, _ in planned}
    if len(planned) > 1:
        _check_phase_overrides(overrides, declared)
    out = []
    for nb, params in planned:
        config = f"configs/{nb.stem}.{profile}.yaml"
        sources = {n: config for n in params} | {n: f"-p {n}" for n in overrides}
        mine = {n: v for n, v in overrides.items()
                if len(planned) == 1 or (declared[nb] is not None and n in declared[nb])}
        params = {**params, **mine}
        check_parameters(nb, params, sources)
        check_values(params, sources, nb, configs.parent)
        out.append((nb, params))
    return out


def _refuse_runner_parameters(params: dict[str, Any], source: str) -> None:
    """Raise :class:`UserInputError` when ``params`` (from ``source``: ``-p`` or a config file)
    sets a :data:`RUNNER_PARAMETERS` name; the runner sets those itself."""
    if given := [n for n in RUNNER_PARAMETERS if n in params]:
        raise UserInputError(f"{source} {given[0]}: the runner writes the sidecar beside the "
                             "executed notebook (<executed>/<phase>/<notebook>/<run>.json); "
                             f"choose the folder with --executed DIR instead"
                             f"{'' if source == '-p' else ' (remove it from the file)'}.")


def _load_all(notebooks: list[Path], profile: str,
              configs: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Each notebook's config; a missing one is skipped (logged) while another of the phase has
    one, else raised."""
    planned, missing = [], []
    for nb in notebooks:
        try:
            planned.append((nb, load_parameters(nb, profile, None, configs)))
        except MissingInputError as exc:
            missing.append(exc)
    if missing and (len(notebooks) == 1 or not planned):
        raise missing[0]
    for exc in missing:  # the notebook's name is in the message
        log.warning("skipped (the rest of the phase runs): %s", exc)
    return planned


def _check_phase_overrides(overrides: dict[str, Any],
                           declared: dict[Path, dict[str, str | None] | None]) -> None:
    """In a phase run every ``-p`` name must be declared by at least one notebook."""
    names = list(dict.fromkeys(n for d in declared.values() for n in d or {}))
    for name in overrides:
        if name not in names:
            raise UserInputError(f"-p {name}: no notebook of this phase has this parameter."
                                 f"{_valid_names(name, names)}")


def _valid_names(name: str, declared: list[str]) -> str:
    """`` Did you mean X? Valid names: ...`` for an unknown ``name``: the declared names a
    ``-p`` or config may set, so without :data:`RUNNER_PARAMETERS` (which the runner sets and
    :func:`plan_parameters` refuses), those named apart."""
    settable = [n for n in declared if n not in RUNNER_PARAMETERS]
    close = difflib.get_close_matches(name, settable, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    runner = [n for n in declared if n in RUNNER_PARAMETERS]
    note = (f" ({', '.join(runner)}: set by the runner; choose the folder with --executed DIR.)"
            if runner else "")
    return f"{hint} Valid names: {', '.join(settable) or 'none'}.{note}"
