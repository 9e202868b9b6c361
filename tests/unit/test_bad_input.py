"""Bad input found by a fresh-user trial: each is refused at once, before anything runs, with a
message that names the fix (CPU; tiny random models from ``tests/engine/_tiny.py``).

Covers ``LLM(use_cuda_graphs=True)`` off CUDA, ``LLM(max_num_seqs=0)`` / ``max_prefill_tokens``,
``SamplingParams(stop_token_ids=[...])`` (vLLM takes a list), unknown ``grpo.train`` keywords and
the runner's ``-p`` names (``sidecar_path`` is set by the runner, so not listed as valid).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from _tiny import tiny_model

from nbhelpers.config import GRPOSettings, SamplingParams

OPTIONS = {"page_size": 16, "num_pages": 24, "max_model_len": 96}


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


# ------------------------------------------------------------- 1: CUDA graphs on a CPU model
def test_cuda_graphs_true_on_a_cpu_model_is_refused_at_construction(model):
    from nbhelpers.engine import LLM
    with pytest.raises(ValueError) as err:
        LLM(model, use_cuda_graphs=True, **OPTIONS)
    msg = str(err.value)
    assert "parameters on cpu" in msg
    assert "leave use_cuda_graphs=None" in msg and "use_cuda_graphs=False on the CPU" in msg


def test_cuda_graphs_none_and_false_stay_accepted_on_the_cpu(model):
    from nbhelpers.engine import LLM
    for value in (None, False):
        llm = LLM(model, use_cuda_graphs=value, **OPTIONS)
        assert llm.runner.use_graphs is False  # None = on iff CUDA


def test_cuda_graphs_true_passes_the_check_for_a_cuda_model():
    from nbhelpers.engine.llm import check_cuda_graphs
    cuda_param = SimpleNamespace(is_cuda=True, device="cuda:0")
    check_cuda_graphs(SimpleNamespace(parameters=lambda: iter([cuda_param])), True)  # no raise
    with pytest.raises(ValueError, match="this one has no parameters"):
        check_cuda_graphs(SimpleNamespace(parameters=lambda: iter([])), True)


# ------------------------------------------------------------- 2: scheduler limits
@pytest.mark.parametrize("kwargs, match", [
    ({"max_num_seqs": 0}, r"LLM\(max_num_seqs=0\): pass an int in \[1, 512\]"),
    ({"max_num_seqs": 513}, r"max_num_seqs=513\): pass an int in \[1, 512\] .*largest decode"),
    ({"max_num_seqs": 2.0}, r"max_num_seqs=2\.0\): pass an int"),
    ({"max_num_seqs": True}, r"max_num_seqs=True\): pass an int"),
    ({"max_prefill_tokens": 0}, r"LLM\(max_prefill_tokens=0\): pass an int >= 1"),
    ({"max_prefill_tokens": "4096"}, r"max_prefill_tokens='4096'\): pass an int >= 1"),
])
def test_bad_scheduler_limits_fail_at_construction(monkeypatch, model, kwargs, match):
    from nbhelpers.engine import LLM, llm
    built = []
    monkeypatch.setattr(llm, "ModelRunner", lambda *a, **k: built.append(a))
    with pytest.raises(ValueError, match=match):
        LLM(model, **kwargs, **OPTIONS)
    assert not built  # refused before the engine model is built


def test_good_scheduler_limits_still_generate(model):
    from nbhelpers.engine import LLM
    llm = LLM(model, max_num_seqs=np.int64(2), max_prefill_tokens=1, **OPTIONS)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_new_tokens=3,
                                                            n=2, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [3, 3, 3, 3]


# ------------------------------------------------------------- 3: stop_token_ids
@pytest.mark.parametrize("given, stored", [
    ([5], (5,)), ((5, 6), (5, 6)), (range(2, 4), (2, 3)), (np.array([7, 8]), (7, 8)),
    ([np.int32(9)], (9,)), (None, ()), ([], ()),
])
def test_stop_token_ids_take_any_sequence_of_ints(given, stored):
    params = SamplingParams(stop_token_ids=given)
    assert params.stop_token_ids == stored
    assert all(type(t) is int for t in params.stop_token_ids)
    hash(params)  # still frozen and hashable
    assert SamplingParams(**params.to_dict()) == params


@pytest.mark.parametrize("given, match", [
    (5, r"stop_token_ids=5: a list of token ids is expected; wrap one id as \[5\]"),
    ("</s>", r"stop_token_ids='</s>': expected a sequence of token ids .*tokenizer\.eos_token_id"),
    ([1, "a"], r"token ids must be ints, got str 'a': pass int ids"),
    ([1.0], r"token ids must be ints, got float 1\.0: pass int ids"),
    ([True], r"token ids must be ints, got bool True"),
    ([-1], r"token ids are >= 0"),
])
def test_bad_stop_token_ids_name_the_fix(given, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(stop_token_ids=given)


def test_stop_token_ids_list_stops_the_engine(model):
    from nbhelpers.engine import LLM
    llm = LLM(model, **OPTIONS)
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    free = llm.generate([[1, 2, 3]], greedy)[0].token_ids
    stop = llm.generate([[1, 2, 3]], SamplingParams(
        temperature=0, max_new_tokens=6, ignore_eos=True, stop_token_ids=[free[1]]))[0]
    assert stop.finish_reason == "stop" and stop.token_ids == free[:free.index(free[1]) + 1]


# ------------------------------------------------------------- 3b: vLLM argument names
@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 8}, r"SamplingParams\(max_tokens=\.\.\.\): use max_new_tokens"),
    ({"logprobs": 1}, (r"SamplingParams\(logprobs=\.\.\.\): logprobs of the sampled tokens are "
                       r"always returned \(Completion\.logprobs / full_logprobs\)")),
    ({"stop": ["x"]}, r"SamplingParams\(stop=\.\.\.\): .*use stop_token_ids"),
])
def test_vllm_only_sampling_names_name_the_fix(kwargs, match):
    with pytest.raises(TypeError, match=match):
        SamplingParams(temperature=0.5, **kwargs)


def test_sampling_params_fields_and_replace_still_work():
    import dataclasses
    import inspect
    params = SamplingParams(0.5, max_new_tokens=8, stop_token_ids=[3])
    assert (params.temperature, params.max_new_tokens, params.stop_token_ids) == (0.5, 8, (3,))
    assert dataclasses.replace(params, n=2).n == 2
    assert "max_new_tokens" in inspect.signature(SamplingParams).parameters


def test_generate_takes_vllm_sampling_params_keyword(model):
    from nbhelpers.engine import LLM
    llm = LLM(model, **OPTIONS)
    greedy = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    positional = llm.generate([[1, 2, 3]], greedy)[0].token_ids
    assert llm.generate([[1, 2, 3]], sampling_params=greedy)[0].token_ids == positional
    with pytest.raises(TypeError, match=r"pass the SamplingParams once, as the second argument "
                                        r"`sampling`"):
        llm.generate([[1, 2, 3]], greedy, sampling_params=greedy)
    with pytest.raises(TypeError, match=r"second argument `sampling`"):
        llm.generate([[1, 2, 3]])


# ------------------------------------------------------------- 4: unknown train keywords
@pytest.mark.parametrize("kwargs, match", [
    ({"foo_bar": 1}, (r"unknown keyword\(s\) \['foo_bar'\]\. train\(\) takes its own "
                      r"keywords \['backend', .*must be a trl\.GRPOConfig field")),
    ({"backnd": "flex"}, (r"'backnd': did you mean 'backend', a keyword of train\(\): "
                          r"train\(\.\.\., backend=\.\.\.\)\?")),
    ({"lora": None}, r"'lora' is a GRPOSettings field: settings=GRPOSettings\(\.\.\., lora="),
    ({"num_generation": 2}, r"did you mean 'num_generations', a GRPOSettings field"),
    ({"log_completion": True}, (r"did you mean 'log_completions', a trl\.GRPOConfig field: "
                                r"train\(\.\.\., log_completions=\.\.\.\)")),
])
def test_unknown_train_keywords_are_refused_before_anything_runs(monkeypatch, tmp_path, kwargs,
                                                                 match):
    from nbhelpers.grpo import trainer
    ran = []
    monkeypatch.setattr(trainer, "_train_local", lambda *a, **k: ran.append(a))
    with pytest.raises(TypeError, match=match):
        trainer.train("tiny-llama", GRPOSettings(), output_dir=tmp_path, **kwargs)
    assert not ran and not list(tmp_path.iterdir())


def test_grpo_config_fields_still_pass_as_overrides(monkeypatch, tmp_path):
    from nbhelpers.grpo import trainer
    ran = []
    monkeypatch.setattr(trainer, "_train_local", lambda *a: ran.append(a))
    trainer.train("tiny-llama", GRPOSettings(), output_dir=tmp_path, log_completions=True,
                  max_steps=3)
    assert ran[0][3] == {"log_completions": True, "max_steps": 3}


# ------------------------------------------------------------- 5: runner-set -p names
def _notebook(path: Path, params: str) -> Path:
    import nbformat
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(params)
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [cell, nbformat.v4.new_code_cell("print(answer)")]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


@pytest.fixture
def repo(tmp_path):
    _notebook(tmp_path / "notebooks/phase0_reference/00_a.ipynb",
              "answer = 1\nsidecar_path = ''")
    _notebook(tmp_path / "notebooks/phase0_reference/01_b.ipynb",
              "other = 2\nsidecar_path = ''")
    (tmp_path / "configs").mkdir()
    return tmp_path


@pytest.mark.parametrize("target", ["00_a", "phase"])
def test_valid_names_leave_out_what_the_runner_refuses(repo, target):
    from nbhelpers.run.params import UserInputError, plan_parameters
    nbs = sorted((repo / "notebooks/phase0_reference").glob("*.ipynb"))
    nbs = nbs[:1] if target == "00_a" else nbs
    with pytest.raises(UserInputError) as err:
        plan_parameters(nbs, "cpu", {"sidecar_pat": "x"}, repo)
    msg = str(err.value)
    valid = msg.split("Valid names: ", 1)[1].split(".", 1)[0]
    assert "sidecar_path" not in valid and "answer" in valid
    assert "Did you mean" not in msg  # the only close name is one the runner refuses
    assert "(sidecar_path: set by the runner; choose the folder with --executed DIR.)" in msg
    with pytest.raises(UserInputError, match=r"-p sidecar_path: .*--executed DIR instead\."):
        plan_parameters(nbs, "cpu", {"sidecar_path": "x"}, repo)


def test_a_config_file_setting_sidecar_path_is_refused_too(repo):
    from nbhelpers.run.params import UserInputError, plan_parameters
    (repo / "configs/00_a.cpu.yaml").write_text("answer: 3\nsidecar_path: /tmp/s.json\n")
    nb = repo / "notebooks/phase0_reference/00_a.ipynb"
    with pytest.raises(UserInputError, match=r"configs/00_a\.cpu\.yaml: sidecar_path: .*"
                                             r"--executed DIR instead \(remove it from the file"):
        plan_parameters([nb], "cpu", {}, repo)


def test_cli_lists_settable_names_only(repo, monkeypatch, capsys):
    from nbhelpers.__main__ import main
    from nbhelpers.run import runner
    monkeypatch.setattr(runner, "REPO", repo)
    assert main(["run", "notebooks/phase0_reference/00_a.ipynb", "-p", "answr", "x"]) == 2
    err = capsys.readouterr().err
    assert "Did you mean 'answer'? Valid names: answer." in err
    assert not (repo / "executed").exists()
