"""nbhelpers.grpo.setup / grpo_stats on the CPU: config building, batch fix-up, stats on fake logs."""

import logging
from types import SimpleNamespace

import pytest
import torch

from nbhelpers.config import GRPOSettings
from nbhelpers.grpo import setup
from nbhelpers.grpo.callbacks import CompletionRecorder, StatisticsCallback
from nbhelpers.grpo.setup import build_config, check_backend, fixed_batch_size


@pytest.mark.parametrize("bs,g,ga,world,expected", [
    (4, 4, 1, 1, 4), (3, 4, 1, 1, 4), (5, 4, 1, 1, 8), (1, 8, 1, 1, 8),
    (2, 4, 2, 1, 2),  # TRL accepts 2 * 2 steps_per_generation = 4
    (1, 4, 1, 2, 2),  # two processes: 2 * 2 = 4
    (3, 6, 4, 1, 3),  # 3 * 4 = 12 divisible by 6
])
def test_fixed_batch_size_follows_trl_rule(bs, g, ga, world, expected):
    got = fixed_batch_size(bs, g, ga, world)
    assert got == expected
    assert got >= bs and (got * ga * world) % g == 0


def test_fixed_batch_size_rejects_zero():
    with pytest.raises(ValueError, match=">= 1"):
        fixed_batch_size(0, 4)


def test_build_config_rounds_batch_with_message(tmp_path, caplog):
    settings = GRPOSettings(per_device_train_batch_size=3, num_generations=4)
    with caplog.at_level(logging.WARNING, logger="nbhelpers.grpo.setup"):
        cfg = build_config(settings, tmp_path)
    assert cfg.per_device_train_batch_size == 4
    assert cfg.generation_batch_size == 4
    assert "raised to 4" in caplog.text and "num_generations=4" in caplog.text


def test_build_config_without_fixup_trl_would_crash(tmp_path):
    """The fix-up is needed: TRL itself raises on the same values."""
    from trl import GRPOConfig

    with pytest.raises(ValueError, match="divisible by num_generations"):
        GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=3, num_generations=4,
                   use_cpu=True, report_to="none")


def test_build_config_translates_top_k_and_cpu(tmp_path, caplog, monkeypatch):
    cfg = build_config(GRPOSettings(top_k=-1), tmp_path)
    on_gpu = torch.cuda.is_available()  # this host: bf16 on a GPU, fp32 on the CPU
    assert cfg.top_k == 0 and cfg.use_cpu is not on_gpu and cfg.bf16 is on_gpu
    monkeypatch.setattr(setup, "is_cuda", lambda: False)  # the CPU path, on any host
    cpu = build_config(GRPOSettings(top_k=-1), tmp_path)
    assert cpu.use_cpu and not cpu.bf16
    assert cfg.min_p == pytest.approx(0.1) and cfg.warmup_steps == pytest.approx(0.1)
    assert "raised" not in caplog.text
    assert build_config(GRPOSettings(top_k=20), tmp_path).top_k == 20


def test_build_config_overrides_and_bad_override(tmp_path):
    assert build_config(GRPOSettings(), tmp_path, log_completions=True).log_completions
    with pytest.raises(TypeError):
        build_config(GRPOSettings(), tmp_path, not_a_field=1)


@pytest.mark.parametrize("name,match", [("cb_sync", "use backend='hf_cb'"),
                                        ("hf_cb_nograph", "rollout backend only"),
                                        ("nope", "unknown")])
def test_backend_errors_name_the_fix(name, match):
    with pytest.raises(ValueError, match=match):
        check_backend(name)


STEP_TENSOR_GIB = 4 / 1024
"""Each fake step holds a 4 MiB tensor on the device the callback measures."""


def _drive(cb, steps):
    """Feed a StatisticsCallback the hooks the Trainer calls, with TRL-shaped logs; each step
    allocates :data:`STEP_TENSOR_GIB` on CUDA when there is one (else on the CPU)."""
    state = SimpleNamespace(global_step=0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for i, logs in enumerate(steps, start=1):
        cb.on_step_begin(None, state, None)
        work = torch.ones(1 << 20, device=device)  # 4 MiB of fp32, alive until the step ends
        state.global_step = i
        cb.on_step_end(None, state, None)
        del work
        cb.on_log(None, state, None, logs=logs)
    cb.on_log(None, state, None, logs={"train_runtime": 1.0, "train_loss": 0.0})


def _logs(i):
    return {"loss": 0.1 * i, "grad_norm": float(i), "kl": 0.01 * i, "reward": 1.0 + i,
            "rewards/match_format_exactly/mean": float(i), "rewards/check_answer/mean": -1.0,
            "rewards/check_answer/std": 0.5, "completions/mean_length": 100.0 + i,
            "learning_rate": 5e-6}


def test_statistics_callback_records_and_summary():
    cb = StatisticsCallback()
    _drive(cb, [_logs(i) for i in range(1, 7)])
    assert [r["step"] for r in cb.records] == [1, 2, 3, 4, 5, 6]
    rec = cb.records[0]
    # GPU: the step's own tensor (the peak is reset each step); CPU: the process RSS
    assert rec["wall_s"] >= 0 and rec["peak_mem_allocated_gib"] >= STEP_TENSOR_GIB
    assert rec["loss"] == pytest.approx(0.1) and rec["completion_length_mean_tokens"] == 101.0
    assert "rewards/check_answer/std" not in rec
    assert cb.reward_keys == ["rewards/match_format_exactly/mean", "rewards/check_answer/mean"]
    s = cb.summary(skip_first=3)  # steps 4, 5, 6
    assert s["n_steps"] == 6 and s["n_steps_in_median"] == 3 and s["note"] is None
    assert s["loss_median"] == pytest.approx(0.5) and s["kl_median"] == pytest.approx(0.05)
    assert s["rewards/match_format_exactly/mean_median"] == 5.0
    assert s["grad_norm_median"] == 5.0 and s["step_time_s_median"] >= 0


def test_statistics_summary_with_few_steps_uses_all_and_says_so(caplog):
    cb = StatisticsCallback()
    _drive(cb, [_logs(1), {**_logs(2), "loss": float("nan")}])
    s = cb.summary(skip_first=3)
    assert s["n_steps_in_median"] == 2 and "only 2 step" in s["note"]
    assert s["loss_median"] == pytest.approx(0.1)  # NaN dropped, not propagated
    assert "only 2 step" in caplog.text
    with pytest.raises(ValueError, match="skip_first"):
        cb.summary(skip_first=-1)


def test_statistics_without_kl_gives_none():
    cb = StatisticsCallback()
    _drive(cb, [{"loss": 0.0}])
    assert cb.summary()["kl_median"] is None


def test_completion_recorder_keeps_names_and_scores():
    def format_reward(completions, **kwargs):
        return [1.0 if "<SOLUTION>" in c[0]["content"] else 0.0 for c in completions]

    def answer_reward(prompts, completions, answer, **kwargs):
        return [2.0, float("nan")]

    rec = CompletionRecorder(max_rows=4)
    wrapped = rec.wrap([format_reward, answer_reward])
    assert [f.__name__ for f in wrapped] == ["format_reward", "answer_reward"]
    prompts = [[{"role": "system", "content": "s"}, {"role": "user", "content": "2+2?"}]] * 2
    comps = [[{"role": "assistant", "content": "<SOLUTION>4</SOLUTION>"}],
             [{"role": "assistant", "content": "five"}]]
    rec.on_step_begin(None, SimpleNamespace(global_step=0), None)
    for f in wrapped:
        f(prompts=prompts, completions=comps, answer=["4", "4"], completion_ids=None)
    assert rec.rows == [
        {"step": 1, "question": "2+2?", "completion": "<SOLUTION>4</SOLUTION>", "answer": "4",
         "format_reward": 1.0, "answer_reward": 2.0},
        {"step": 1, "question": "2+2?", "completion": "five", "answer": "4",
         "format_reward": 0.0, "answer_reward": None}]
    rec.on_step_begin(None, SimpleNamespace(global_step=1), None)
    for f in wrapped:
        f(prompts=prompts, completions=comps, answer=["4", "4"])
    rec.on_step_begin(None, SimpleNamespace(global_step=2), None)
    wrapped[0](prompts=prompts, completions=comps, answer=["4", "4"])
    assert len(rec.rows) == 4 and {r["step"] for r in rec.rows} == {1, 2}


def test_train_checks_its_arguments_before_any_step(tmp_path):
    """Bad arguments fail before the model loads (a run is never lost at its end)."""
    from nbhelpers.grpo import train
    with pytest.raises(ValueError, match="skip_first=-1: must be an int >= 0"):
        train("tiny-llama", GRPOSettings(max_steps=1), output_dir=tmp_path, skip_first=-1)
    with pytest.raises(TypeError, match="pass nbhelpers.config.GRPOSettings"):
        train("tiny-llama", {"max_steps": 1}, output_dir=tmp_path)
