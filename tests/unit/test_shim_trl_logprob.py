"""nbhelpers.shims.trl_fused_logprob_cpu: the torch stand-in's math, and when it is installed."""

import importlib.util

import pytest
import torch

from nbhelpers.shims import trl_fused_logprob_cpu as shim

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _case(seed=0, n=5, h=8, v=11):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    bias = torch.randn(v, generator=g)
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, bias, targets


def test_outputs_match_direct_formulas():
    hidden, weight, bias, targets = _case()
    logp, ent, sq, mean, top1 = shim.TorchLogProb.apply(
        hidden, weight, bias, targets, 0.7, 1024, 30.0, 0.5, shim.OUTPUT_NAMES)
    z = 30.0 * torch.tanh((hidden @ weight.t() + bias) * 0.5 / 30.0) / 0.7
    p = torch.softmax(z, -1)
    torch.testing.assert_close(logp, torch.log(p[torch.arange(5), targets]))
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1))
    torch.testing.assert_close(sq, torch.log((p * p).sum(-1)))
    torch.testing.assert_close(mean, z.mean(-1))
    assert torch.equal(top1, z.argmax(-1) == targets)
    (logp.sum() + ent.sum()).backward()  # differentiable through autograd
    assert hidden.grad is not None and torch.isfinite(weight.grad).all()


def test_only_requested_outputs_are_computed():
    hidden, weight, _, targets = _case(1)
    out = shim.TorchLogProb.apply(hidden, weight, None, targets, 1.0, 4096, None, 1.0,
                                  ("log_probs",))
    assert out[0].shape == (5,) and out[1:] == (None, None, None, None)


@pytest.mark.skipif(HAS_TRITON, reason="with Triton TRL uses its own kernel; the shim stays out")
def test_canary_trl_still_lacks_a_cpu_path_and_install_fills_it(monkeypatch):
    """When this fails, TRL imports a log-prob function without Triton: delete the shim."""
    import trl.trainer.utils as trl_utils

    with pytest.raises(ImportError, match="triton"):
        import trl.kernels  # noqa: F401  (what leaves TRL's slot empty)
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", None)  # as at import, pre-install
    assert shim.is_needed() and shim.install()
    assert trl_utils._ChunkedLogProbFunction is shim.TorchLogProb
    assert not shim.install()  # already filled: nothing replaced


def test_install_leaves_an_existing_kernel_alone(monkeypatch):
    import trl.trainer.utils as trl_utils

    sentinel = object()
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", sentinel)
    assert not shim.is_needed() and not shim.install()
    assert trl_utils._ChunkedLogProbFunction is sentinel
