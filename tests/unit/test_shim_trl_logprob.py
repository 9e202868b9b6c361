"""nbhelpers.shims.trl_fused_logprob_cpu: the torch stand-in's math, and when it is installed."""

import subprocess
import sys

import torch

from nbhelpers.shims import trl_fused_logprob_cpu as shim


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


def test_canary_trl_still_lacks_a_cpu_path_without_triton():
    """When this fails, TRL imports a log-prob function without Triton: delete the shim.

    Runs in a subprocess where ``import triton`` is blocked (whether or not triton is installed
    here), as on every CPU-only torch build without it."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import trl.trainer.utils as u\n"
        "from nbhelpers.shims import trl_fused_logprob_cpu as shim\n"
        "assert u._ChunkedLogProbFunction is None, u._ChunkedLogProbFunction\n"
        "assert shim.is_needed() and shim.install() and not shim.install()\n"
        "assert u._ChunkedLogProbFunction is shim.TorchLogProb\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=900, check=False)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_install_keeps_the_kernel_for_cuda_and_routes_cpu_tensors_to_torch(monkeypatch):
    """A GPU host training a CPU policy (the tests' forced-CPU runs on the H200): CUDA inputs go
    to TRL's kernel, CPU inputs to the torch stand-in."""
    import trl.trainer.utils as trl_utils

    calls = []

    class Kernel:
        @staticmethod
        def apply(hidden, *args, **kwargs):
            calls.append(hidden)
            return "kernel"

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Kernel)
    # install() sets this class attribute; restore it too, or a later CUDA GRPO run in the same
    # worker (whose install() is then a no-op: the restored slot already holds DeviceDispatch)
    # calls the fake and TRL fails on its "kernel" string (seen on the H100, 2026-12-07:
    # "'str' object has no attribute 'new_zeros'" in test_grpo_flex's [cuda] fixture)
    monkeypatch.setattr(shim.DeviceDispatch, "kernel", shim.DeviceDispatch.kernel)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert shim.is_needed() and shim.install()
    assert trl_utils._ChunkedLogProbFunction is shim.DeviceDispatch
    assert not shim.is_needed() and not shim.install()

    class FakeCuda:
        is_cuda = True
    assert shim.DeviceDispatch.apply(FakeCuda(), None) == "kernel" and len(calls) == 1
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(3, 8, generator=g), torch.randn(11, 8, generator=g)
    targets = torch.tensor([1, 5, 10])
    got = shim.DeviceDispatch.apply(hidden, weight, None, targets, 1.0, 4)
    want = shim.TorchLogProb.apply(hidden, weight, None, targets, 1.0, 4)
    assert torch.equal(got[0], want[0]) and len(calls) == 1


def test_install_replaces_the_triton_kernel_without_cuda(monkeypatch):
    """Triton installed on a CPU host: TRL's slot holds its kernel, which cannot run here."""
    import trl.trainer.utils as trl_utils

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert shim.is_needed() and shim.install()
    assert trl_utils._ChunkedLogProbFunction is shim.TorchLogProb
    assert not shim.is_needed() and not shim.install()  # filled: nothing more to do


def test_the_dispatch_kernel_is_restored_after_the_fake_kernel_test():
    """Runs after the test above in one process (file order): the fake kernel must not outlive
    it (it broke a CUDA GRPO fixture that ran after it in one xdist worker)."""
    kernel = shim.DeviceDispatch.kernel
    assert kernel is None or getattr(kernel, "__name__", "") != "Kernel", kernel
