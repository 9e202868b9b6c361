"""scripts/device/fa4_probe.py's LM-head hook: it must not read logits back inside a CUDA graph
capture (session 20's probe failed every graphs=True configuration that way on an H100)."""

import importlib
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts/device"))
    return importlib.import_module("fa4_probe")


def test_eager_calls_count_non_finite_logits(probe):
    hook = probe.NonFinite()
    hook(None, (), torch.tensor([[0.0, 1.0]]))
    hook(None, (), torch.tensor([[float("nan"), 1.0]]))
    assert (hook.calls, hook.bad, hook.captured) == (2, 1, 0)


def test_a_captured_forward_is_counted_and_not_read_back(probe, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)

    class NoReadBack:
        is_cuda = True

    def refuse(*_a, **_k):
        raise AssertionError("the hook read the logits back during a capture")

    monkeypatch.setattr(torch, "isfinite", refuse)
    hook = probe.NonFinite()
    hook(None, (), NoReadBack())
    assert (hook.calls, hook.bad, hook.captured) == (0, 0, 1)


@pytest.mark.parametrize("graphs,arg", [(False, "0"), (True, "1"), ((True, False), "10"),
                                        ((False, True), "01")])
def test_graphs_round_trip_through_the_child_argument(probe, graphs, arg):
    assert probe.graphs_arg(graphs) == arg and probe.parse_graphs(arg) == graphs


def test_a_bad_graphs_argument_names_the_forms(probe):
    with pytest.raises(ValueError, match="use 0, 1, 10 or 01"):
        probe.parse_graphs("2")


def test_only_split_runs_the_reference_and_the_two_split_configs(probe, monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(probe, "run_shape", lambda name, out, configs: seen.append(configs) or 0)
    assert probe.main(["--shapes", "w", "--only-split", "--out", str(tmp_path)]) == 0
    assert seen == [(("paged|sdpa", False), ("paged|flash_attention_4", (True, False)),
                     ("paged|flash_attention_4", (False, True)))]
