"""Interactive controls for the notebooks under JupyterLab (DESIGN.md "Interactive use").

Contract: :func:`run_controls` builds an ipywidgets panel (one picker per choice, a Run button, an
output area) around a function the notebook already uses; clicking Run calls it with the picked
values and displays what it returns. The widgets hold no logic. Under papermill the panel is only
displayed (nobody clicks), so a headless run is unchanged; without ipywidgets installed the
function prints how to get it and returns ``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def _picker(name: str, options: Sequence[Any], default: Any) -> Any:
    import ipywidgets as w
    opts = list(options)
    if isinstance(default, (list, tuple)):  # several values: a multi-select
        return w.SelectMultiple(options=opts, value=tuple(v for v in default if v in opts),
                                description=name, rows=min(len(opts), 8))
    if default not in opts:
        opts = [default, *opts]
    return w.Dropdown(options=opts, value=default, description=name)


def run_controls(run: Callable[..., Any], **choices: tuple[Sequence[Any], Any]) -> Any:
    """A ``VBox`` of pickers plus a Run button that calls ``run(**picked)``.

    Args:
        run: the notebook's function (it calls ``nbhelpers``); its return value is displayed.
        choices: ``name=(options, default)``; a list/tuple default gives a multi-select whose
            value is passed as a list, a scalar default a dropdown.
    Returns:
        The panel (display it, or let the cell show it), or ``None`` without ipywidgets.
    Raises:
        ValueError: no choices, or a choice that is not ``(options, default)``.
    """
    if not choices:
        raise ValueError("run_controls needs at least one name=(options, default) choice.")
    for name, spec in choices.items():
        if not (isinstance(spec, tuple) and len(spec) == 2):
            raise ValueError(f"run_controls: {name}={spec!r} must be (options, default).")
    try:
        import ipywidgets as w
    except ImportError:
        print("interactive controls need ipywidgets: pip install -e '.[notebooks]' "
              "(the parameters cell drives headless runs).")
        return None
    from IPython.display import display
    pickers = {name: _picker(name, *spec) for name, spec in choices.items()}
    button, out = w.Button(description="Run", button_style="primary"), w.Output()

    def picked() -> dict[str, Any]:
        return {n: list(p.value) if isinstance(p, w.SelectMultiple) else p.value
                for n, p in pickers.items()}

    def on_click(_: Any) -> None:
        out.clear_output()
        with out:
            panel.last_result = run(**picked())
            if panel.last_result is not None:
                display(panel.last_result)

    button.on_click(on_click)
    panel = w.VBox([*pickers.values(), button, out])
    panel.picked = picked  # the values a click would pass (tests, scripting)
    panel.last_result = None  # what the last click's run returned
    return panel
