"""nbhelpers.widgets: a click calls the notebook's function with the picked values and shows its
result; without ipywidgets the helper says how to get it."""

import builtins

import pytest

from nbhelpers import widgets

pytest.importorskip("ipywidgets", reason="ipywidgets is in the notebooks extra")


def test_click_calls_run_with_the_picked_values():
    calls = []

    def run(backends, n_prompts):
        calls.append((backends, n_prompts))
        return f"ran {backends} x {n_prompts}"

    panel = widgets.run_controls(run, backends=(["hf_generate", "hf_cb", "flex"], ["flex"]),
                                 n_prompts=([4, 8, 32], 8))
    pick_backends, pick_n, button, _out = panel.children
    assert panel.picked() == {"backends": ["flex"], "n_prompts": 8}
    pick_backends.value = ("hf_cb", "flex")
    pick_n.value = 32
    button.click()
    assert calls == [(["hf_cb", "flex"], 32)]
    assert panel.last_result == "ran ['hf_cb', 'flex'] x 32"


def test_a_default_outside_the_options_is_offered():
    panel = widgets.run_controls(lambda n: None, n=([1, 2], 5))
    assert panel.children[0].options == (5, 1, 2) and panel.picked() == {"n": 5}


def test_bad_choices_raise():
    with pytest.raises(ValueError, match="at least one"):
        widgets.run_controls(lambda: None)
    with pytest.raises(ValueError, match="must be \\(options, default\\)"):
        widgets.run_controls(lambda n: None, n=[1, 2])


def test_without_ipywidgets_it_prints_the_install_and_returns_none(monkeypatch, capsys):
    real = builtins.__import__

    def no_ipywidgets(name, *a, **k):
        if name == "ipywidgets":
            raise ImportError("no ipywidgets")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_ipywidgets)
    assert widgets.run_controls(lambda n: None, n=([1], 1)) is None
    assert "pip install -e '.[notebooks]'" in capsys.readouterr().out
