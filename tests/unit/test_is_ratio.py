"""Importance sampling over one support for flex (issue 13 part 2), on the CPU in fp32.

The done-when: with engine and trainer sharing weights, the ratio on one support is 1 within fp32
noise (mean within 0.01 of 1, <= 5 % of tokens outside [0.9, 1.1]); the unrenormalised one
(engine's filtered logprob vs the trainer's full softmax, TRL's ratio today) is not, under
min_p 0.1. Then the same through TRL's GRPOTrainer (FlexGRPOTrainer, two steps).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from nbhelpers.config import GRPOSettings, LoraSpec, SamplingParams
from nbhelpers.grpo.flex_rollout import IS_KEYS, is_ratio, pad_rows, token_is_stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from _tiny import random_prompts, tiny_model

T = 1.0


def test_is_ratio_follows_trls_modes():
    tr = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
    sa = torch.tensor([[-1.1, -1.0, 5.0], [-0.5, -0.7, -0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    tok = torch.exp((tr - sa) * mask)
    torch.testing.assert_close(is_ratio(tr, sa, mask, "token_truncate", None, 1.1),
                               tok.clamp(max=1.1))
    torch.testing.assert_close(is_ratio(tr, sa, mask, "token_mask", None, 1.1),
                               tok.masked_fill(tok > 1.1, 0.0))
    seq = torch.exp(((tr - sa) * mask).sum(-1, keepdim=True))
    torch.testing.assert_close(is_ratio(tr, sa, mask, "sequence_mask", None, 3.0),
                               seq.masked_fill(seq > 3.0, 0.0))
    nan = is_ratio(tr, torch.full_like(sa, float("nan")), mask, "token_truncate")
    assert torch.equal(nan, torch.ones_like(nan))
    with pytest.raises(ValueError, match="use one of"):
        is_ratio(tr, sa, mask, "tokens")
    st = token_is_stats(tr, sa, mask)
    assert st[IS_KEYS["outside"]] == pytest.approx(0.6) and st[IS_KEYS["same_support"]] > 0
    assert token_is_stats(tr, sa, mask, same_support=False)[IS_KEYS["same_support"]] is None
    assert pad_rows([[1.0], [2.0, 3.0]], 3).tolist() == [[1.0, 0.0, 0.0], [2.0, 3.0, 0.0]]


def test_gate_reports_is_stats_as_info():
    from nbhelpers.grpo.gate import check_run, thresholds_for
    base = {"loss": 0.1, "grad_norm": 0.5, "reward": 0.0, "kl": 0.0}
    rows = [base | {"step": s, "is_token_ratio_mean": 0.7, "is_token_outside_0.9_1.1": 0.6,
                    "same_support_logp_diff_mean": None} for s in (1, 2)]
    check = next(c for c in check_run("vllm", rows, thresholds_for("random")).checks
                 if c.name == "importance_sampling")
    assert check.status == "info" and "0.7" in check.detail and "n/a" in check.detail
    check = next(c for c in check_run("hf_generate", [base | {"step": 1}],
                                      thresholds_for("random")).checks
                 if c.name == "importance_sampling")
    assert check.status == "skip"


@pytest.fixture(scope="module")
def shared_weights_rollout():
    """Engine completions (min_p 0.1) and the trainer's full-softmax logprobs of the same tokens
    from one set of weights, plus the trainer's own mass over the engine's support (PR #7269)."""
    from nbhelpers.engine import LLM
    from nbhelpers.engine.sampler import filtered_probs
    torch.set_num_threads(1)
    model = tiny_model("qwen3")
    with torch.no_grad():  # random init is near uniform: min_p would keep every token
        model.lm_head.weight.mul_(3.0)
    llm = LLM(model, page_size=16, num_pages=256, max_model_len=96)
    sp = SamplingParams(temperature=T, min_p=0.1, n=4, max_new_tokens=48, seed=11)
    outs = llm.generate(random_prompts(4, 6, 12, seed=5), sp)
    eng_f, eng_full, trainer, trainer_mass = [], [], [], []
    for o in outs:
        with torch.no_grad():
            x = model(torch.tensor([o.prompt_ids + o.token_ids])).logits[0].float()
        x = x[len(o.prompt_ids) - 1:-1] / T
        tok = torch.tensor(o.token_ids)
        trainer.append(torch.log_softmax(x, -1).gather(1, tok[:, None])[:, 0])
        n = len(tok)
        kept = filtered_probs(x, torch.ones(n), torch.full((n,), 0.1), torch.zeros(n, dtype=torch.long),
                              torch.ones(n), use_sort=False) > 0
        trainer_mass.append(torch.log((torch.softmax(x, -1) * kept).sum(-1)))
        eng_f.append(torch.tensor(o.logprobs))
        eng_full.append(torch.tensor(o.full_logprobs))
    return [torch.cat(v) for v in (eng_f, eng_full, trainer, trainer_mass)]


def test_ratio_on_one_support_is_one_and_unrenormalised_is_not(shared_weights_rollout):
    eng_f, eng_full, trainer, trainer_mass = shared_weights_rollout
    mask = torch.ones_like(trainer)
    ours = token_is_stats(trainer, eng_full, mask)
    biased = token_is_stats(trainer, eng_f, mask)
    print(f"\ntokens={trainer.numel()} kept mass mean={float((eng_full - eng_f).exp().mean()):.4f}"
          f" | on one support: ratio mean={ours[IS_KEYS['ratio_mean']]:.6f} outside="
          f"{ours[IS_KEYS['outside']]:.4f} |dlogp|={ours[IS_KEYS['same_support']]:.2e}"
          f" | unrenormalised: ratio mean={biased[IS_KEYS['ratio_mean']]:.4f} outside="
          f"{biased[IS_KEYS['outside']]:.4f}")
    assert trainer.numel() >= 500
    assert abs(ours[IS_KEYS["ratio_mean"]] - 1) < 0.01 and ours[IS_KEYS["outside"]] <= 0.05
    assert float((trainer - eng_full).abs().max()) < 1e-4  # fp32 noise
    assert abs(biased[IS_KEYS["ratio_mean"]] - 1) > 0.05 and biased[IS_KEYS["outside"]] > 0.2
    # TRL PR #7269's form (trainer renormalised by its own mass over the engine's support)
    pr7269 = (trainer - trainer_mass - eng_f).exp()
    assert float((pr7269 - 1).abs().max()) < 1e-3


@pytest.fixture(scope="module")
def flex_is_run(tmp_path_factory):
    from nbhelpers.grpo import setup as grpo_setup
    from nbhelpers.grpo import train
    torch.set_num_threads(1)
    settings = GRPOSettings(max_steps=2, num_generations=4, per_device_train_batch_size=4,
                            max_completion_length=8, learning_rate=2e-2, warmup_ratio=0.0,
                            lr_scheduler_type="constant", min_p=0.1, beta=0.04,
                            lora=LoraSpec(rank=4, alpha=8, targets=("q_proj", "v_proj")))
    mp = pytest.MonkeyPatch()
    mp.setattr(grpo_setup, "is_cuda", lambda: False)
    try:
        return train("tiny-llama", settings, backend="flex", n_questions=4, progress=False,
                     output_dir=tmp_path_factory.mktemp("flex_is"), skip_first=0,
                     reward_funcs=[lambda completions=(), **k: [float(len(str(c))) for c in
                                                                completions]])
    finally:
        mp.undo()


def test_grpo_flex_applies_the_ratio_and_logs_it(flex_is_run):
    logs = [h for h in flex_is_run.log_history if IS_KEYS["ratio_mean"] in h]
    assert len(logs) == 2
    for h in logs:
        assert abs(h[IS_KEYS["ratio_mean"]] - 1) < 0.01 and h[IS_KEYS["outside"]] <= 0.05
        assert h[IS_KEYS["same_support"]] < 1e-3
        assert abs(h["sampling/importance_sampling_ratio/mean"] - 1) < 0.01  # TRL's, as applied
    rec = flex_is_run.records
    assert all(r.get("is_token_ratio_mean") is not None for r in rec)
