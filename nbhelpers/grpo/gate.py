"""Coherence gate for GRPO runs: do the backends train sanely, and the same?

Contract: :func:`check_run` takes one run's per-step rows (:func:`nbhelpers.grpo.trainer.
step_rows`: dicts with ``step``, ``loss``, ``grad_norm``, ``reward``, ``kl``,
``sampling/sampling_logp_difference/mean``) and returns a :class:`GateResult` of named checks,
each ``pass`` / ``fail`` / ``skip`` with a one-line detail:

* ``loss_finite``, ``grad_norm_finite``: every step logged a finite value.
* ``reward_range``: every step's mean reward lies in ``Thresholds.reward_range``.
* ``kl_early``: KL of the first ``kl_early_steps`` steps in ``[0, kl_max_early]``; the reference
  experiment's KL trajectories stayed in [0, 0.015] over 10 steps for vLLM and Unsloth
  (Unsloth PR #5108, ``scripts/benchmarks/results/grpo_equivalence.md``; research/anchors.md).
  TRL logs KL only when ``beta > 0``: with ``beta == 0`` the check is skipped, saying so.
* ``kl_vs_reference``: per step, ``|kl - kl_ref| <= kl_tolerance`` against the reference backend.
* ``reward_vs_reference``: the median reward is within ``reward_tolerance`` of the reference's.
* ``grad_norm_vs_reference``: the median ``grad_norm`` within a factor ``grad_ratio_max`` (3) of
  the reference's. Why: KL and rewards over a short run cannot tell a backend whose updates are
  ~100x smaller from one that trains: on SmolLM2-135M real weights (H200, 2026-12-03, 30 steps,
  ``min_p=0.1``) vLLM colocate under TRL 1.15's default importance-sampling correction
  (``sequence_mask``: exp of the summed per-token logprob gaps, which vLLM's min_p-renormalised
  logprobs make ~0) had median grad norm 0.0016 against 0.27 (flex) and 0.32 (hf_generate), and
  passed both KL and reward checks. The factor 3 leaves room for sampling noise (flex /
  hf_generate: 0.85 there). Skipped when the reference's median is 0 (untrained: see
  ``learning_signal``). The detail names TRL's applied IS weight mean when the row has it;
  :func:`grad_gap_sentence` states a failure as a sentence (29_compare's conclusion).
* ``learning_signal`` (``info``, never failing): how many steps had ``grad_norm > 0``. With
  reward ties in every group (all -7.5 for a model that never writes the format tags) GRPO's
  advantages are zero, nothing trains, and the KL checks pass without testing anything.
* ``logprob_mismatch``: mean ``|engine logprob - trainer logprob|`` (nats/token) <=
  ``logprob_mismatch_max``; skipped for backends that report no logprobs (hf_generate, hf_cb,
  unsloth fi=False). Engines report *processed* logprobs (after ``min_p`` / ``top_k`` /
  ``top_p``: the flex sampler, and vLLM as TRL asks for ``processed_logprobs``) while the trainer's
  are temperature-scaled full-softmax ones, so with a filtering sampler the gap includes
  ``-log(kept probability mass)`` (0.2-0.3 nats/token measured on SmolLM2 with ``min_p=0.1``). With
  ``Thresholds.sampling_is_filtered`` the check is ``info`` (value reported, never failing); it
  is a hard check when sampling is unfiltered (``min_p=0``, ``top_p=1``, ``top_k`` off).
* ``importance_sampling`` (``info``, never failing): the per-step token IS ratio
  ``exp(trainer - engine)`` mean, fraction of tokens outside [0.9, 1.1] and mean
  |engine - trainer| logprob on one support (:data:`nbhelpers.grpo.flex_rollout.IS_KEYS`, step
  rows' ``is_*`` keys); skipped for backends without engine logprobs. Issue 13's CPU target for
  flex: mean within 0.01 of 1, <= 5 % outside.

:func:`check_runs` gates several backends against one reference; :func:`assert_gate` raises
:class:`GateFailed` listing every failed check (the notebook's last cell calls it). A run that
errored is a failure unless its error is a missing engine (``BackendNotInstalled``): that backend
could not be staged, which the report states and the gate does not hide; or unless it was
stopped from outside before it finished (:func:`is_interrupted`: a device call's time cap or a
user's stop; :mod:`nbhelpers.grpo.progress`): that run is not finished, so its one check
``ran`` is ``skip`` saying so (its steps are shown, not gated). A run whose process died on its
own (``ChildExit: interrupted after ...``) still fails ``ran``.

Run: ``pytest tests/unit/test_gate.py``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any

MISMATCH_MEAN = "sampling/sampling_logp_difference/mean"
REWARD_BOUNDS = (-10.0, 13.0)
"""Sum of the reference reward functions' bounds (nbhelpers/grpo/rewards.py docstrings): format exact
[0, 3], format approximate [-3, 1.5], answer [-4.5, 5], numbers [-2.5, 3.5]."""
RANDOM_WEIGHTS_REWARD = (-10.0, -4.0)
"""Random-weight models write no format tags: each completion scores -3 - 2 - 2.5 = -7.5
(grpo/rewards.py: approximate -1.0 for each of 3 missing tags, answer -2.0, numbers -2.5). A chance
tag lifts one completion by 1.5, so a step mean above -4 needs most completions to write tags:
with random weights that means the rewards or the decoding are broken."""


@dataclass(frozen=True)
class Thresholds:
    """Gate limits (units: rewards as scored, KL in nats, logprob gaps in nats/token)."""

    reward_range: tuple[float, float] = REWARD_BOUNDS
    kl_max_early: float = 0.015
    kl_early_steps: int = 10
    kl_tolerance: float = 0.015
    reward_tolerance: float = 3.0
    logprob_mismatch_max: float = 0.1
    sampling_is_filtered: bool = False
    grad_ratio_max: float = 3.0

    def __post_init__(self) -> None:
        lo, hi = self.reward_range
        if not lo < hi:
            raise ValueError(f"Thresholds.reward_range={self.reward_range}: need low < high.")
        if min(self.kl_max_early, self.kl_tolerance, self.reward_tolerance,
               self.logprob_mismatch_max) < 0 or self.kl_early_steps < 1:
            raise ValueError("Thresholds: tolerances must be >= 0 and kl_early_steps >= 1.")
        g = self.grad_ratio_max
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 1 <= g < math.inf:
            raise ValueError(f"Thresholds.grad_ratio_max={g!r}: must be a finite number >= 1 "
                             "(a factor: 3 accepts a median grad norm from 1/3 to 3x the "
                             "reference's).")


def thresholds_for(model_kind: str, sampling: Any = None, **overrides: Any) -> Thresholds:
    """:class:`Thresholds` for a model kind (``random`` | ``real`` | ``hub``): random weights get
    :data:`RANDOM_WEIGHTS_REWARD`, others the full :data:`REWARD_BOUNDS`. ``sampling`` (a
    :class:`~nbhelpers.config.SamplingParams`) sets ``sampling_is_filtered``."""
    rng = RANDOM_WEIGHTS_REWARD if model_kind == "random" else REWARD_BOUNDS
    filtered = sampling is not None and (sampling.min_p > 0 or sampling.top_p < 1
                                         or sampling.top_k > 0)
    return Thresholds(**({"reward_range": rng, "sampling_is_filtered": filtered} | overrides))


@dataclass
class Check:
    name: str
    status: str  # "pass" | "fail" | "skip" | "info" (reported, not gated)
    detail: str


@dataclass
class GateResult:
    """Checks of one backend's run; ``passed`` is True when no check failed."""

    backend: str
    checks: list[Check] = field(default_factory=list)
    error: str | None = None

    @property
    def passed(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    def status(self, name: str) -> str:
        return next(c.status for c in self.checks if c.name == name)

    def as_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "passed": self.passed, "error": self.error,
                "checks": [asdict(c) for c in self.checks]}


class GateFailed(AssertionError):
    """The coherence gate failed; the message lists every failed check."""


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _series(rows: list[dict[str, Any]], key: str) -> list[Any]:
    return [r.get(key) for r in rows]


def _check_finite(rows: list[dict[str, Any]], key: str) -> Check:
    bad = [(r.get("step"), r.get(key)) for r in rows if not _finite(r.get(key))]
    if not rows:
        return Check(f"{key}_finite", "fail", "no steps recorded")
    if bad:
        return Check(f"{key}_finite", "fail", f"non-finite or missing {key} at (step, value) {bad}")
    return Check(f"{key}_finite", "pass", f"{len(rows)} steps finite")


def _check_reward(rows: list[dict[str, Any]], th: Thresholds) -> Check:
    lo, hi = th.reward_range
    bad = [(r.get("step"), r.get("reward")) for r in rows
           if not (_finite(r.get("reward")) and lo <= r["reward"] <= hi)]
    if bad:
        return Check("reward_range", "fail", f"reward outside [{lo}, {hi}] at {bad}")
    vals = [r["reward"] for r in rows]
    return Check("reward_range", "pass", f"rewards {min(vals):.3g}..{max(vals):.3g} in [{lo}, {hi}]")


def _check_kl_early(rows: list[dict[str, Any]], th: Thresholds) -> Check:
    kls = _series(rows[:th.kl_early_steps], "kl")
    if all(k is None for k in kls):
        return Check("kl_early", "skip", "no KL logged (TRL logs it only with beta > 0)")
    bad = [(r.get("step"), r.get("kl")) for r in rows[:th.kl_early_steps]
           if not (_finite(r.get("kl")) and 0.0 <= r["kl"] <= th.kl_max_early)]
    if bad:
        return Check("kl_early", "fail", f"KL outside [0, {th.kl_max_early}] at {bad}")
    return Check("kl_early", "pass", f"max KL {max(kls):.3g} <= {th.kl_max_early}")


def _check_kl_ref(rows, ref_rows, th: Thresholds) -> Check:
    if ref_rows is None:
        return Check("kl_vs_reference", "skip", "this is the reference run (or none given)")
    ref = {r.get("step"): r.get("kl") for r in ref_rows}
    pairs = [(r.get("step"), r.get("kl"), ref.get(r.get("step"))) for r in rows]
    pairs = [p for p in pairs if _finite(p[1]) and _finite(p[2])]
    if not pairs:
        return Check("kl_vs_reference", "skip", "no step with KL in both runs")
    worst = max(pairs, key=lambda p: abs(p[1] - p[2]))
    gap = abs(worst[1] - worst[2])
    status = "pass" if gap <= th.kl_tolerance else "fail"
    return Check("kl_vs_reference", status, f"max |KL - KL_ref| = {gap:.3g} at step {worst[0]} "
                 f"(tolerance {th.kl_tolerance}, {len(pairs)} steps compared)")


def _check_reward_ref(rows, ref_rows, th: Thresholds) -> Check:
    mine = [r["reward"] for r in rows if _finite(r.get("reward"))]
    theirs = [r["reward"] for r in (ref_rows or []) if _finite(r.get("reward"))]
    if ref_rows is None or not mine or not theirs:
        return Check("reward_vs_reference", "skip", "no reference rewards to compare")
    gap = abs(median(mine) - median(theirs))
    status = "pass" if gap <= th.reward_tolerance else "fail"
    return Check("reward_vs_reference", status, f"|median reward - reference| = {gap:.3g} "
                 f"(tolerance {th.reward_tolerance})")


def _median_of(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if _finite(r.get(key))]
    return median(vals) if vals else None


def _mean_of(rows: list[dict[str, Any]], key: str) -> float | None:
    """Mean of ``key`` over the rows that have a finite value (the sidecar's IS summary is the
    mean over steps too), ``None`` when none has."""
    vals = [r[key] for r in rows if _finite(r.get(key))]
    return sum(vals) / len(vals) if vals else None


def _grad_gap(rows, ref_rows) -> tuple[float, float, float, float | None] | str:
    """``(median grad norm, the reference's, their ratio, mean TRL applied IS weight or None)``,
    or why the two cannot be compared (no finite grad norms; a reference that did not train)."""
    mine, ref = _median_of(rows, "grad_norm"), _median_of(ref_rows or [], "grad_norm")
    if mine is None or ref is None:
        return "no finite grad norms to compare"
    if ref <= 0:
        return f"the reference did not train (median grad norm {ref:.3g})"
    return mine, ref, mine / ref, _mean_of(rows, "is_ratio_applied_mean")


def _check_grad_ref(rows, ref_rows, th: Thresholds) -> Check:
    name = "grad_norm_vs_reference"
    if ref_rows is None:
        return Check(name, "skip", "this is the reference run (or none given)")
    gap = _grad_gap(rows, ref_rows)
    if isinstance(gap, str):
        return Check(name, "skip", gap)
    mine, ref, ratio, applied = gap
    why = (f"; TRL's applied IS weight (mean over steps {applied:.3g}) scales the loss"
           if applied is not None and ratio < 1 / th.grad_ratio_max else "")
    status = "pass" if 1 / th.grad_ratio_max <= ratio <= th.grad_ratio_max else "fail"
    return Check(name, status, f"median grad norm {mine:.3g} = {ratio:.3g} x the "
                 f"reference's {ref:.3g} (limit {th.grad_ratio_max:g}x either way){why}")


IS_SWITCHES = ("vllm_importance_sampling_correction=False",
               "vllm_importance_sampling_mode='token_truncate'")
"""TRL's ``GRPOConfig`` switches that stop its IS correction from scaling the loss to ~0."""


def grad_gap_sentence(label: str, rows: list[dict[str, Any]],
                      ref_rows: list[dict[str, Any]] | None, reference: str,
                      thresholds: Thresholds | None = None) -> str | None:
    """One sentence for a failed ``grad_norm_vs_reference`` check of run ``label``: its policy
    gradient is much smaller (or larger) than the ``reference`` backend's, with the medians.
    When the run's TRL applied IS weight (``is_ratio_applied_mean``, mean over steps) is below
    ``1 / grad_ratio_max`` (the weight alone scales the loss past the gate's factor) it says that
    TRL's importance-sampling correction scales the loss and names :data:`IS_SWITCHES`.
    ``None`` when the two medians are not comparable or lie within the limit (no failure)."""
    th = thresholds or Thresholds()
    gap = _grad_gap(rows, ref_rows)
    if isinstance(gap, str):
        return None
    mine, ref, ratio, applied = gap
    if 1 / th.grad_ratio_max <= ratio <= th.grad_ratio_max:
        return None
    size = "much smaller" if ratio < 1 else "much larger"
    out = (f"{label}: the policy gradient is {size} than the reference's ({reference}: median "
           f"grad norm {mine:.3g} = {ratio:.3g} x {ref:.3g}, limit {th.grad_ratio_max:g}x "
           "either way)")
    if ratio < 1 and applied is not None and applied < 1 / th.grad_ratio_max:
        out += (f"; TRL's applied IS weight has mean {applied:.3g} over steps: TRL's "
                "importance-sampling "
                "correction (vllm_importance_sampling_mode sequence_mask, TRL's default: exp of "
                "the summed per-token logprob gaps, which min_p-renormalised engine logprobs "
                f"push to ~0) scales the loss; {IS_SWITCHES[0]} or {IS_SWITCHES[1]} are TRL's "
                "switches")
    return out + "."


def _check_mismatch(rows: list[dict[str, Any]], th: Thresholds) -> Check:
    vals = [v for v in _series(rows, MISMATCH_MEAN) if v is not None]
    if not vals:
        return Check("logprob_mismatch", "skip", "backend reports no sampled-token logprobs")
    worst = max(vals, key=lambda v: v if _finite(v) else math.inf)
    if th.sampling_is_filtered:
        return Check("logprob_mismatch", "info", f"mean |engine - trainer| logprob per step max "
                     f"{worst:.3g} nats/token; not gated: processed (min_p/top_k/top_p) vs "
                     "full-softmax logprobs")
    bad = [v for v in vals if not (_finite(v) and v <= th.logprob_mismatch_max)]
    status = "fail" if bad else "pass"
    return Check("logprob_mismatch", status, f"mean |engine - trainer| logprob per step max "
                 f"{worst:.3g} nats/token (limit {th.logprob_mismatch_max})")


def _check_is(rows: list[dict[str, Any]]) -> Check:
    def worst(key: str, far: Any) -> float | None:
        vals = [v for v in _series(rows, key) if v is not None]
        return max(vals, key=far) if vals else None
    mean = worst("is_token_ratio_mean", lambda v: abs(v - 1) if _finite(v) else math.inf)
    if mean is None:
        return Check("importance_sampling", "skip", "backend reports no IS ratio")
    out = worst("is_token_outside_0.9_1.1", lambda v: v if _finite(v) else math.inf)
    gap = worst("same_support_logp_diff_mean", lambda v: v if _finite(v) else math.inf)
    support = "n/a (engine reports no kept mass)" if gap is None else f"{gap:.3g} nats/token"
    return Check("importance_sampling", "info", f"token IS ratio mean furthest from 1: {mean:.4g}; "
                 f"max fraction outside [0.9, 1.1]: {out:.3g}; |engine - trainer| on one "
                 f"support, max step mean: {support}")


def _check_signal(rows: list[dict[str, Any]]) -> Check:
    moved = sum(1 for r in rows if _finite(r.get("grad_norm")) and r["grad_norm"] > 0)
    note = "" if moved else ": every reward tie gives zero advantages, so the KL checks compare " \
                            "untrained policies (use a model that scores, or more steps)"
    return Check("learning_signal", "info", f"{_SIGNAL}{moved}/{len(rows)} steps{note}")


_SIGNAL = "grad_norm > 0 at "
"""The ``learning_signal`` detail's start (:func:`_check_signal`, :func:`untrained`)."""


def untrained(gate: dict[str, Any]) -> bool:
    """Whether a gate's (:meth:`GateResult.as_dict`, or a sidecar's ``gate``)
    ``learning_signal`` check saw ``grad_norm`` 0 at every step (the backends were compared
    untrained)."""
    return any(c.get("name") == "learning_signal" and c.get("detail", "").startswith(
        f"{_SIGNAL}0/") for c in gate.get("checks", []))


def check_run(backend: str, rows: list[dict[str, Any]], thresholds: Thresholds,
              reference_rows: list[dict[str, Any]] | None = None) -> GateResult:
    """Gate one run (see module docstring); ``reference_rows`` None = no cross-backend checks.
    A run with no step rows fails one check, ``steps``."""
    if not rows:
        return GateResult(backend, [Check("steps", "fail", "the run logged no step rows (did "
                                          "training start? see the run's error / log)")])
    return GateResult(backend, [
        _check_finite(rows, "loss"), _check_finite(rows, "grad_norm"),
        _check_reward(rows, thresholds), _check_kl_early(rows, thresholds),
        _check_kl_ref(rows, reference_rows, thresholds),
        _check_reward_ref(rows, reference_rows, thresholds),
        _check_grad_ref(rows, reference_rows, thresholds), _check_mismatch(rows, thresholds),
        _check_is(rows), _check_signal(rows)])


def is_not_staged(error: str | None) -> bool:
    """True for a run that failed only because its engine is not installed here."""
    return bool(error) and error.startswith("BackendNotInstalled")


INTERRUPTED = "interrupted after"
"""How an unfinished run's ``error`` text starts after its ``"<cause type>: "``
(:func:`nbhelpers.grpo.progress.interrupted_run`)."""
STOP_CAUSES = ("KeyboardInterrupt", "SystemExit", "SIGTERM", "SIGINT")
"""Cause types of a run stopped from outside (the notebook interrupted, the child signalled)."""


def is_interrupted(error: str | None) -> bool:
    """True for a run stopped from outside before it finished (``"<one of STOP_CAUSES>:
    interrupted after N logged steps ..."``): not a failure, not a finished run."""
    kind, _, text = str(error or "").partition(": ")
    return kind in STOP_CAUSES and text.startswith(INTERRUPTED)


def check_runs(runs: dict[str, dict[str, Any]], reference: str, thresholds: Thresholds,
               reference_run: dict[str, Any] | None = None) -> dict[str, GateResult]:
    """Gate every backend of ``runs`` (``{backend: {"rows": [...], "error": str | None}}``).

    The ``reference`` backend is gated without cross checks; the others against it. When
    ``reference`` is not among ``runs`` (a run of some backends only, e.g. one per device call),
    ``reference_run`` (the same dict shape, e.g. from an earlier run's sidecar via
    :func:`nbhelpers.grpo.compare.runs_from_sidecars`) is the reference; without it the cross
    checks are skipped with that reason (``29_compare`` gates the latest runs across calls).
    """
    ref = runs.get(reference, reference_run)
    ref_rows = None if ref is None or ref.get("error") else ref.get("rows")
    cross = ("kl_vs_reference", "reward_vs_reference", "grad_norm_vs_reference")
    out = {}
    for name, run in runs.items():
        if run.get("error"):
            status = ("skip" if is_not_staged(run["error"]) or is_interrupted(run["error"])
                      else "fail")
            out[name] = GateResult(name, [Check("ran", status, run["error"])], run["error"])
            continue
        out[name] = check_run(name, run["rows"], thresholds,
                              None if name == reference else ref_rows)
        if name == reference or (ref is not None and not ref.get("error")):
            continue
        why = (f"reference backend {reference!r} is not in this run (runs: {sorted(runs)}); "
               "29_compare gates the latest runs together" if ref is None else
               f"reference backend {reference!r} "
               f"{_ref_word(ref['error'])} "
               f"({str(ref['error'])[:80]}): nothing to compare against")
        for c in out[name].checks:
            if c.name in cross:
                c.status, c.detail = "skip", why
    return out


def _ref_word(error: str) -> str:
    return ("is not staged" if is_not_staged(error) else
            "did not finish" if is_interrupted(error) else "failed")


def assert_gate(results: dict[str, GateResult]) -> None:
    """Raise :class:`GateFailed` listing every failed check of every backend."""
    failed = [f"{r.backend}.{c.name}: {c.detail}" for r in results.values() for c in r.checks
              if c.status == "fail"]
    if failed:  # the first line names the first failure: INDEX.md and logs show one line
        more = f" (+{len(failed) - 1} more below)" if len(failed) > 1 else ""
        raise GateFailed(f"coherence gate failed: {failed[0][:200]}{more}\n  "
                         + "\n  ".join(failed))
