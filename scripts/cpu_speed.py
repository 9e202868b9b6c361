"""CPU speed of the flex engine's default path vs HF ``generate`` (issue 12 item 6).

What: SmolLM2-135M-Instruct fp32 (real weights), GSM8K prompts (chat template, first ``batch``
questions of ``nbhelpers.data.load_gsm8k``), 32 greedy new tokens, at batch 1 and batch 8:
``LLM(model).generate`` with no options (or the ``--option`` ones) against HF
``model.generate(do_sample=False)`` (left-padded batch, sdpa attention). Each point is timed
``--repeats`` times, engine and HF interleaved, after one warm-up call each (same process, same
threads); the JSON keeps every
sample, the medians and whether the engine's tokens equal HF's (HF pads the batch, so its
batch-8 tokens may differ in the last ulp-sensitive places; batch 1 is the exact check).

Run (threads pinned so two cores shared with others give comparable numbers)::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/cpu_speed.py --out /tmp/cpu_speed.json
    OMP_NUM_THREADS=1 .venv/bin/python scripts/cpu_speed.py --option decode_attention=flex \
        --option prefill_attention=flex        # the old eager flex path, for the A/B

Assets: ``.venv/bin/python -m nbhelpers fetch smollm2-135m-instruct`` and ``... fetch gsm8k``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import time

import torch

MODEL = "smollm2-135m-instruct"


def prompts(tok, batch: int) -> list[list[int]]:
    from nbhelpers.data import chat_ids, load_gsm8k
    return [chat_ids(tok, [{"role": "user", "content": r["question"]}])
            for r in load_gsm8k(batch)]


def hf_generate(model, tok, batch_prompts: list[list[int]], new: int) -> list[list[int]]:
    """HF greedy ``generate`` over a left-padded batch; the new tokens of each row."""
    width = max(map(len, batch_prompts))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch_prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=pad)
    return out[:, width:].tolist()


def engine_generate(llm, batch_prompts: list[list[int]], new: int) -> list[list[int]]:
    from nbhelpers.config import SamplingParams
    sp = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    return [o.token_ids for o in llm.generate(batch_prompts, sp)]


def timed_pair(fa, fb, repeats: int) -> tuple[list[float], list[float], list, list]:
    """Seconds of ``repeats`` calls of each, interleaved (a, b, a, b, ...) after one warm-up
    call each, so load from other processes on a shared host hits both alike."""
    out_a, out_b = fa(), fb()  # warm-up (first-call allocations, page pool, lazy imports)
    sa, sb = [], []
    for _ in range(repeats):
        for fn, samples in ((fa, sa), (fb, sb)):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return sa, sb, out_a, out_b


def parse_options(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def run(batches: list[int], new: int, repeats: int, options: dict) -> dict:
    from nbhelpers.engine import LLM
    from nbhelpers.models import load_model
    model, tok = load_model(MODEL, dtype="float32", device="cpu", attn_implementation="sdpa")
    model.eval()
    llm = LLM(model, **options)
    points = []
    for b in batches:
        ps = prompts(tok, b)
        eng_s, hf_s, eng_tok, hf_tok = timed_pair(lambda ps=ps: engine_generate(llm, ps, new),
                                                  lambda ps=ps: hf_generate(model, tok, ps, new),
                                                  repeats)
        points.append({"batch": b, "prompt_tokens": [len(p) for p in ps], "new_tokens": new,
                       "engine_s": eng_s, "hf_s": hf_s,
                       "engine_median_s": statistics.median(eng_s),
                       "hf_median_s": statistics.median(hf_s),
                       "speedup_vs_hf": statistics.median(hf_s) / statistics.median(eng_s),
                       "same_tokens_as_hf": eng_tok == hf_tok,
                       "rows_same_as_hf": sum(a == h for a, h in zip(eng_tok, hf_tok))})
        print(json.dumps({k: v for k, v in points[-1].items() if "median" in k or k in (
            "batch", "speedup_vs_hf", "same_tokens_as_hf", "rows_same_as_hf")}), flush=True)
    return {"model": MODEL, "dtype": "float32", "options": options,
            "engine_kernels": {"decode_attention": llm.runner.decode_attention,
                               "prefill_attention": getattr(llm.runner, "prefill_attention",
                                                            "flex")},
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "repeats": repeats, "points": points}


def _env() -> dict:
    """The git sha (``NBHELPERS_GIT_SHA`` or ``git rev-parse``), UTC time and host, so a stored
    JSON names the code and the moment it measured."""
    import platform
    import subprocess
    sha = os.environ.get("NBHELPERS_GIT_SHA")
    if not sha:
        try:
            sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, timeout=10, check=False,
                                 cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except OSError:
            sha = None
    return {"git_sha": sha or None, "platform": platform.platform(),
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--option", action="append", default=[], help="RunnerOptions key=value")
    ap.add_argument("--note", default="", help="free text stored in the JSON (host load...)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    result = run(args.batches, args.new_tokens, args.repeats, parse_options(args.option))
    result["note"] = args.note
    result["env"] = _env()
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
