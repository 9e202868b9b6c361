"""Issue 13 part 4 (CPU side): the compile_dynamic switch and what it changes in recompiles."""

import pytest
import torch

from nbhelpers.grpo.compile_report import CompileWatch


@pytest.mark.parametrize("dynamic,most", [(False, None), (True, 0)])
def test_compile_dynamic_changes_recompiles(dynamic, most):
    torch._dynamo.reset()
    with CompileWatch("default", dynamic=dynamic) as watch:
        f = torch.compile(torch.nn.Linear(4, 4), dynamic=dynamic)
        for n in (2, 3, 5, 7):
            f(torch.randn(n, 4))
    rep = watch.report()
    assert rep["compile_dynamic"] is dynamic
    if most is None:  # static shapes: one recompile per new batch size
        assert rep["recompiles"] >= 3
    else:
        assert rep["recompiles"] == most
