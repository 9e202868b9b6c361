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


def test_train_passes_compile_dynamic_to_the_compile_and_its_report(tmp_path, monkeypatch):
    """train(compile_dynamic=True) reaches compile_trainer_models and the compile report (the
    compile itself is recorded, not run: test_grpo_flex compiles the backbone for real)."""
    from nbhelpers.config import GRPOSettings
    from nbhelpers.grpo import compile_report, train
    seen = []
    monkeypatch.setattr(compile_report, "compile_trainer_models",
                        lambda trainer, mode, dynamic=None, scope="backbone":
                        seen.append((mode, dynamic, scope)) or [])
    torch.set_num_threads(1)
    settings = GRPOSettings(max_steps=1, num_generations=2, per_device_train_batch_size=2,
                            max_completion_length=4)
    res = train("tiny-llama", settings, backend="hf_generate", n_questions=2, progress=False,
                output_dir=tmp_path, skip_first=0, compile_mode="default", compile_dynamic=True)
    assert seen == [("default", True, "backbone")]  # hf_generate: auto -> backbone
    assert res.config["compile_report"]["compile_dynamic"] is True
    with pytest.raises(ValueError, match="compile_dynamic='yes'"):
        train("tiny-llama", settings, output_dir=tmp_path, compile_dynamic="yes")
