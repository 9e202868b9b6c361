"""Same-process CPU A/B of the live-weights check (``ModelRunner.begin_generate``, session 14).

What: the CPU default GRPO rollout path, SmolLM2-135M-Instruct fp32 (real weights) with a PEFT
LoRA r32 adapter on q/k/v/o/gate/up/down (fp32, PEFT's default), ``n`` samples of one prompt,
min_p 0.1 sampling, ``max_new_tokens`` new tokens, ignore EOS. Two modes, alternated
``--repeats`` times after one warm-up call, same process, same engine:

* ``once`` (the engine's path): one check of every projection group's LoRA tensors per
  ``LLM.generate`` call; the groups' eager forwards skip theirs (``LiveGroup.checked``).
* ``every_forward`` (the path before): the runner checks before every prefill and decode window
  and each group again on every eager forward (``begin_generate`` replaced by a no-op).

Writes ``--out`` (JSON: every sample, medians, whether both modes gave the same tokens, torch
threads, git sha, UTC). Run::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/cpu_weights_check_ab.py --out /tmp/ab.json

Assets: ``.venv/bin/python -m nbhelpers fetch smollm2-135m-instruct``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from datetime import UTC, datetime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=150)
    args = ap.parse_args()
    for name in ("repeats", "max_new_tokens", "n", "prompt_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")

    import torch
    from peft import LoraConfig, get_peft_model

    from nbhelpers.config import SamplingParams
    from nbhelpers.engine import LLM
    from nbhelpers.models import load_model
    torch.manual_seed(0)
    model, _ = load_model("smollm2-135m-instruct", dtype="float32")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=32, lora_alpha=64, target_modules=targets),
                           autocast_adapter_dtype=True).eval()
    llm = LLM(model)
    runner = llm.runner
    begin = runner.begin_generate
    modes = {"once": begin, "every_forward": lambda: None}
    sp = SamplingParams(temperature=1.0, min_p=0.1, max_new_tokens=args.max_new_tokens,
                        ignore_eos=True, seed=1, n=args.n)
    prompt = [list(range(100, 100 + args.prompt_tokens))]
    llm.generate(prompt, sp)  # warm-up
    samples: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, list] = {}
    for _ in range(args.repeats):
        for mode, fn in modes.items():
            runner.begin_generate = fn
            t0 = time.perf_counter()
            out = llm.generate(prompt, sp)
            samples[mode].append(time.perf_counter() - t0)
            tokens[mode] = [c.token_ids for c in out]
    runner.begin_generate = begin
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, check=False).stdout.strip() or None
    res = {"what": "CPU A/B of the live-weights check, scripts/cpu_weights_check_ab.py",
           "model": "smollm2-135m-instruct fp32 + PEFT LoRA r32 fp32 (7 targets)",
           "workload": {"n": args.n, "prompt_tokens": args.prompt_tokens,
                        "max_new_tokens": args.max_new_tokens, "min_p": 0.1},
           "samples_s": samples, "median_s": {m: statistics.median(v) for m, v in samples.items()},
           "same_tokens": tokens["once"] == tokens["every_forward"],
           "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
           "git_sha": sha, "utc": datetime.now(UTC).isoformat(timespec="seconds")}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in ("median_s", "same_tokens", "torch_threads")}))


if __name__ == "__main__":
    main()
