"""Flex IS ratio at loss time (nbhelpers.grpo.flex_is) against the extra-forward path, on the CPU.

On-policy (TRL computes no ``old_per_token_logps``), FlexGRPOTrainer builds the ratio from the
loss forward's detached logprobs instead of a no-grad forward at generation. The same two GRPO
steps of tiny-llama (fp32) run both ways in one process (``_defer_is=False`` forces the path
before): losses, every trainable gradient, the ratio of each micro-batch and every logged
``sampling/*`` metric agree to 1e-6 relative, and the policy runs one forward chunk fewer per
generation batch. The rollout's logprobs are shifted by a fixed per-token offset so the ratios
spread around 1 and each mode's clip bites (with shared weights they are 1 within 1e-5).
Off-policy (``num_iterations=2``) TRL's own forward and ratio-at-generation stay.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerCallback
from trl import GRPOTrainer

from nbhelpers.config import GRPOSettings, LoraSpec
from nbhelpers.grpo import flex_rollout as grpo_flex
from nbhelpers.grpo.flex_is import (
    FILTERED_IS_KEYS,
    FULL_KEY,
    IS_APPLIED_MEAN,
    IS_KEYS,
    RowCollector,
    is_ratio,
    is_report,
    trl_computes_old_logps,
)

CLIPS = {"token": (0.9, 1.1), "sequence": (0.7, 1.5)}
"""(clip_min, clip_max) per ratio level: the shifted logprobs put tokens on both sides."""


def _shift(rows, phase):
    """A fixed offset per token, different for each row and position: up to 0.25 nats a token,
    and over 8 tokens sequence ratios of about 1.9, 0.8, 0.84, 0.36 for rows 0-3."""
    return [[lp + 0.15 * math.sin(3.0 * i + 5.0 * j + phase) + 0.05 * (i - 1)
             for j, lp in enumerate(row)] for i, row in enumerate(rows)]


class ShiftedRollout(grpo_flex.FlexRollout):
    def __call__(self, prompts, trainer):
        out = super().__call__(prompts, trainer)
        out[FULL_KEY], out["logprobs"] = _shift(out[FULL_KEY], 0.0), _shift(out["logprobs"], 1.0)
        return out


class Grads(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                           if p.requires_grad})


class Spy(GRPOTrainer):
    """Below FlexGRPOTrainer in the MRO: sees TRL's own generation output and the batch that
    TRL's loss read (after the loss-time ratio was written into it)."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.rec["trl_old"].append("old_per_token_logps" in out)
        return out

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        self.rec["loss"].append(loss.detach().clone())
        for key in ("importance_sampling_ratio", "old_per_token_logps",
                    "sampling_per_token_logps", "completion_mask"):
            value = inputs.get(key)
            self.rec[key].append(None if value is None else value.detach().clone())
        return loss

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if kwargs.get("compute_entropy"):
            self.rec["loss_logps"].append(out[0].detach().clone())
        return out


def run(tmp_path, defer, mode="sequence_mask", gas=1, bs=4, steps=2, **overrides):
    """Two GRPO steps through ``train``; returns what the spy, the forward counter and the
    gradient callback saw, and the log history."""
    from nbhelpers.grpo import setup as grpo_setup
    from nbhelpers.grpo import train
    torch.set_num_threads(1)
    rec = {k: [] for k in ("trl_old", "loss", "importance_sampling_ratio", "old_per_token_logps",
                           "sampling_per_token_logps", "completion_mask", "loss_logps")}
    rec["forwards"] = 0

    class Probe(grpo_flex.FlexGRPOTrainer, Spy):
        _defer_is = defer

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.rec = rec
            rec["trainer"] = self
            self.model.register_forward_pre_hook(
                lambda *_: rec.__setitem__("forwards", rec["forwards"] + 1))

    lo, hi = CLIPS[mode.split("_")[0]]
    settings = GRPOSettings(max_steps=steps, num_generations=4, per_device_train_batch_size=bs,
                            gradient_accumulation_steps=gas, max_completion_length=8,
                            learning_rate=2e-2, warmup_ratio=0.0, lr_scheduler_type="constant",
                            min_p=0.1, beta=0.04,
                            lora=LoraSpec(rank=4, alpha=8, targets=("q_proj", "v_proj")))
    grads = Grads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grpo_setup, "is_cuda", lambda: False)
        mp.setattr(grpo_flex, "FlexGRPOTrainer", Probe)
        mp.setattr(grpo_flex, "FlexRollout", ShiftedRollout)
        result = train("tiny-llama", settings, backend="flex", n_questions=4, progress=False,
                       output_dir=tmp_path / f"defer_{defer}", skip_first=0, callbacks=[grads],
                       reward_funcs=[lambda completions=(), **k: [float(len(str(c)))
                                                                  for c in completions]],
                       vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=lo,
                       vllm_importance_sampling_clip_max=hi, **overrides)
    logs = [{k: v for k, v in h.items() if k.startswith("sampling/")}
            for h in result.log_history if "loss" in h]
    return rec, grads.steps, logs


def _close(new, old):
    """fp32: 1e-6 relative; ``atol`` 1e-6 of the largest value (exact zeros, e.g. lora_A's
    gradient while lora_B is still 0, compare as zeros)."""
    scale = max(float(old.abs().max()), 1e-12)
    torch.testing.assert_close(new, old, rtol=1e-6, atol=1e-6 * scale)


ON_POLICY = [  # (mode, GRPOConfig) -- generation rows G = bs * steps_per_generation = 4
    ("token_truncate", {}),
    ("sequence_mask", {}),  # TRL's default mode
    ("token_mask", {"gas": 2, "bs": 2}),  # two micro-batches of 2 rows per generation batch
    ("sequence_truncate", {"gas": 2, "bs": 2}),
    # num_iterations=2 yet on-policy in TRL's test: both passes inside one optimizer step
    ("token_truncate", {"gas": 2, "bs": 4, "steps_per_generation": 1, "num_iterations": 2}),
]


@pytest.mark.parametrize(("mode", "cfg"), ON_POLICY, ids=lambda x: str(x))
def test_loss_time_ratio_equals_the_extra_forward_path(tmp_path, mode, cfg):
    (old, old_grads, old_logs) = run(tmp_path, False, mode, **cfg)
    (new, new_grads, new_logs) = run(tmp_path, True, mode, **cfg)
    assert old["trl_old"] == new["trl_old"] == [False, False]  # TRL's decision, both runs
    assert all(x is not None for x in old["old_per_token_logps"])  # the extra forward's
    assert all(x is None for x in new["old_per_token_logps"])  # TRL: per_token_logps.detach()
    assert len(new["loss"]) == len(old["loss"]) == 2 * cfg.get("gas", 1)
    for a, b in zip(new["loss"], old["loss"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    for a, b in zip(new["importance_sampling_ratio"], old["importance_sampling_ratio"]):
        _close(a, b)  # per micro-batch: the rows line up
    for key in ("sampling_per_token_logps", "completion_mask"):
        assert all(torch.equal(a, b) for a, b in zip(new[key], old[key]))
    assert len(new_grads) == len(old_grads) == 2
    for g_new, g_old in zip(new_grads, old_grads):
        assert g_new.keys() == g_old.keys() and len(g_new) == 8  # q, v x A, B x 2 layers
        for name in g_old:
            _close(g_new[name], g_old[name])
    assert any(float(g.abs().max()) > 1e-4 for g in new_grads[1].values())
    assert len(new_logs) == len(old_logs) == 2
    for a, b in zip(new_logs, old_logs):
        keys = set(IS_KEYS.values()) | set(FILTERED_IS_KEYS.values()) | {IS_APPLIED_MEAN}
        assert keys <= a.keys() and a.keys() == b.keys()
        for key in b:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
    ratios = torch.cat([r.flatten() for r in new["importance_sampling_ratio"]])
    lo, hi = CLIPS[mode.split("_")[0]]
    bitten = (ratios == 0) if mode.endswith("mask") else (ratios == lo) | (ratios == hi)
    assert bitten.any() and not bitten.all()  # the clip acted on some rows/tokens, not all


def test_on_policy_drops_the_extra_forward(tmp_path):
    """Per step (one generation batch of 4 rows): the policy's forward calls are the reference
    logprobs (beta > 0, PEFT adapter off) + the loss's micro-batches, + the extra no-grad
    forward's chunks (``per_device_train_batch_size`` rows each) on the path before."""
    for cfg, chunks in (({}, 1), ({"gas": 2, "bs": 2}, 2)):
        old = run(tmp_path, False, **cfg)[0]["forwards"]
        new = run(tmp_path, True, **cfg)[0]["forwards"]
        gas = cfg.get("gas", 1)
        assert new == 2 * (chunks + gas), (cfg, new)
        assert old - new == 2 * chunks, (cfg, old, new)


@pytest.mark.parametrize("defer", [True, False])
def test_off_policy_keeps_trls_old_logprobs(tmp_path, defer):
    """num_iterations=2, one micro-batch per optimizer step: TRL computes old_per_token_logps
    (its forward at generation), the ratio is made there, and the second pass of the same batch
    (after one optimizer step) applies that ratio, not one from the moved policy."""
    rec = run(tmp_path, defer, "token_truncate", num_iterations=2)[0]
    assert rec["trl_old"] == [True]  # one generation for both steps
    assert rec["forwards"] == 3 + 1  # TRL's old + ref + loss; then the loss alone
    old_1, old_2 = rec["old_per_token_logps"]
    assert torch.equal(old_1, old_2)  # the generation batch's, reused
    mask, sampling = rec["completion_mask"][1], rec["sampling_per_token_logps"][1]
    lo, hi = CLIPS["token"]
    expected = is_ratio(old_2, sampling, mask, "token_truncate", lo, hi)
    assert torch.equal(rec["importance_sampling_ratio"][1], expected)
    moved = (rec["loss_logps"][1] - old_2)[mask.bool()].abs().max()
    assert moved > 1e-4  # the policy moved: a loss-time ratio would differ
    torch.testing.assert_close(rec["loss_logps"][0], old_1, rtol=1e-6, atol=1e-6)


def test_eval_loss_and_metrics_equal_the_extra_forward_path(tmp_path):
    """TRL's evaluate: one generation and one loss over the eval batch (``_prepare_inputs``),
    so the loss-time report is complete after that loss."""
    seen = []
    for defer in (False, True):
        rec = run(tmp_path, defer, "token_truncate", steps=1)[0]
        torch.manual_seed(0)  # the same rollouts for both
        metrics = rec["trainer"].evaluate(eval_dataset=rec["trainer"].train_dataset.select([0]))
        seen.append({k: v for k, v in metrics.items() if "sampling" in k or k == "eval_loss"})
        assert rec["trl_old"] == [False, False]  # train, eval
        assert (rec["old_per_token_logps"][-1] is None) == defer  # the eval loss's batch
    keys = {f"eval_{k}" for k in (*IS_KEYS.values(), *FILTERED_IS_KEYS.values(),
                                  IS_APPLIED_MEAN)}
    assert keys <= seen[1].keys() and seen[0].keys() == seen[1].keys()
    assert seen[1] == pytest.approx(seen[0], rel=1e-6, abs=1e-9)
    assert abs(seen[1]["eval_sampling/importance_sampling_ratio/mean"] - 1) > 1e-3  # shifted


def test_trl_computes_old_logps_is_trls_test():
    def trainer(gas, spg, ni, use_vllm=False, correction=True):
        return SimpleNamespace(args=SimpleNamespace(gradient_accumulation_steps=gas,
                                                    steps_per_generation=spg),
                               num_iterations=ni, use_vllm=use_vllm,
                               vllm_importance_sampling_correction=correction)
    assert not trl_computes_old_logps(trainer(1, 1, 1))
    assert not trl_computes_old_logps(trainer(4, 2, 1))  # two generations per optimizer step
    assert not trl_computes_old_logps(trainer(2, 1, 2))  # num_iterations 2 inside one step
    assert trl_computes_old_logps(trainer(1, 1, 2))
    assert trl_computes_old_logps(trainer(1, 2, 1))  # steps_per_generation > accumulation
    assert trl_computes_old_logps(trainer(3, 2, 1))
    assert trl_computes_old_logps(trainer(1, 1, 1, use_vllm=True))
    assert not trl_computes_old_logps(trainer(1, 1, 1, use_vllm=True, correction=False))


def test_row_collector_reports_the_whole_batch():
    g = torch.Generator().manual_seed(0)
    tr, sa, fi = (torch.randn(6, 5, generator=g) * 0.1 for _ in range(3))
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    ratio = is_ratio(tr, sa, mask, "token_truncate", 0.95, 1.05)
    whole = is_report(tr, sa, fi, mask, ratio)
    rows = RowCollector(6)
    assert not rows.add(tr[:2], sa[:2], fi[:2], mask[:2], ratio[:2])
    assert rows.add(tr[2:], sa[2:], fi[2:], mask[2:], ratio[2:])
    assert rows.report() == pytest.approx(whole, rel=1e-6)
    parts = RowCollector(6)
    parts.add(tr[:3], sa[:3], None, mask[:3], ratio[:3])
    assert not set(FILTERED_IS_KEYS.values()) & parts.report().keys()
    with pytest.raises(ValueError, match="num_rows=0"):
        RowCollector(0)
