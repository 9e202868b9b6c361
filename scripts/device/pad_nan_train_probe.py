"""Probe: which backward op gives padded CUDA GRPO runs their NaN gradients?

Why: on an H100 (2026-12-07, e858b3e and again at 765b55b)
``tests/unit/test_pad_to_multiple_of.py``'s
tiny-llama runs (bf16 on CUDA) padded with ``pad_to_multiple_of=64`` had a finite loss and
``grad_norm`` NaN at step 1 (flex and hf_generate; unpadded runs and every CPU run finite). The
attention hypothesis is ruled out: ``pad_nan_probe.py`` found no NaN gradient from any sdpa kernel
with left padding, and the runs still failed with fully masked rows unmasked (step ``t18`` at
765b55b, whose trainer ran sdpa with such rows unmasked on CUDA; that change was then removed:
it fixed nothing). A finite loss with a NaN gradient is the
signature of a masked-out position whose local derivative is inf/NaN (``where`` / ``* mask``
multiply it by 0: 0 * inf = NaN), so this runs the test's padded training with
``torch.autograd.detect_anomaly(check_nan=True)``: the first backward op that returns NaN raises
with the forward traceback of the op that created it. Also prints, per step, the parameters whose
gradient is not finite (a hook on each LoRA parameter).

Run: ``python3 scripts/device/pad_nan_train_probe.py --out $OUT`` (CUDA; on a CPU host a dry
run: no NaN expected there). Needs trl, the SmolLM2 GGUF (tiny-llama's tokenizer) and GSM8K.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
import warnings

import probe_log


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None,
                    help="folder: the lines also go to pad_nan_train_probe.log")
    ap.add_argument("--backends", default="hf_generate,flex")
    ap.add_argument("--pads", default="64,0")
    args = ap.parse_args(argv)

    def say(line: str) -> None:
        probe_log.say(line, args.out, "pad_nan_train_probe.log")

    import torch

    from nbhelpers.config import GRPOSettings, LoraSpec
    from nbhelpers.grpo import step_rows, train

    def reward(prompts=None, completions=(), **kwargs):
        return [float(str(c).count("e")) for c in completions]

    from transformers import TrainerCallback

    class NanHooks(TrainerCallback):
        """At train begin, a gradient hook on every trainable parameter that records the names
        whose gradient is not finite."""
        def __init__(self) -> None:
            self.bad: list[str] = []

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            for name, p in model.named_parameters():
                if p.requires_grad:
                    p.register_hook(lambda g, n=name: self.bad.append(n)
                                    if not torch.isfinite(g).all() else None)

    for backend in args.backends.split(","):
        for pad in (int(p) for p in args.pads.split(",")):
            settings = GRPOSettings(max_steps=2, num_generations=4, per_device_train_batch_size=4,
                                    max_completion_length=8, learning_rate=2e-2,
                                    warmup_ratio=0.0, lr_scheduler_type="constant", min_p=0.1,
                                    beta=0.04, lora=LoraSpec(rank=4, alpha=8,
                                                             targets=("q_proj", "v_proj")),
                                    pad_to_multiple_of=pad)
            hooks = NanHooks()
            head = f"{backend} pad={pad}:"
            caught: list = []
            try:
                with tempfile.TemporaryDirectory() as tmp, \
                        warnings.catch_warnings(record=True) as caught, \
                        torch.autograd.detect_anomaly(check_nan=True):
                    warnings.simplefilter("always")
                    res = train("tiny-llama", settings, backend=backend, n_questions=4,
                                progress=False, output_dir=tmp, skip_first=0,
                                reward_funcs=[reward], callbacks=[hooks])
                rows = step_rows(res)
                say(f"{head} no anomaly; grad_norm per step "
                    f"{[r.get('grad_norm') for r in rows]}; loss {[r.get('loss') for r in rows]}; "
                    f"non-finite grads in {sorted(set(hooks.bad))[:6]}")
            except Exception as err:  # noqa: BLE001 (a probe: every case reported)
                tb = traceback.format_exc()
                say(f"{head} {type(err).__name__}: {str(err)[:400]}")
                say(f"{head} non-finite grads in {sorted(set(hooks.bad))[:6]}")
                # the anomaly's forward traceback is in the warnings printed to stderr just before;
                # the exception's own frames (last 40 lines) name the backward op
                for line in tb.splitlines()[-40:]:
                    say(f"    {line}")
            for w in caught:  # anomaly mode's "Traceback of forward call that caused the error"
                if "forward call" in str(w.message):
                    for line in str(w.message).splitlines()[-30:]:
                        say(f"    fwd| {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
