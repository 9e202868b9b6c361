"""Probe hf_cb's FlashAttention-4 path against sdpa, CUDA graphs off and on, on Qwen3-4B.

What: hf_cb with ``paged|flash_attention_4`` on Qwen3-4B (random bf16 weights) against
``paged|sdpa``, CUDA graphs off and on, at a small greedy shape and at phase 1's workload W.

Why: on the H200 (2026-12-03, ``executed/phase1_rollout/10_lora_rollout/20261203T221743Z_h200_
48b88b7*``) phase 1's ``hf_cb_fa4`` (workload W: 32 prompts of ~150 tokens, 512 new tokens, LoRA
r32 adapter, GRPO sampling, CUDA graphs on) died with "probability tensor contains either inf,
nan or element < 0" in the sampler after FA4's varlen kernel ran, while phase 2's hf_cb with the
same FA4 set (4 sequences) finished 6 steps. The first version of this probe (session 17, step
``f4p``, ``executed/phase1_rollout/fa4_probe/20261203T234703Z_h200_fdcc5b8.f4p.log``) ran only
the small greedy shape without LoRA: FA4 finished with graphs off and on, 95 and 59 of 512 greedy
tokens equal to sdpa's. Greedy decoding cannot see NaN logits (argmax returns an index), and that
run had no sdpa-vs-sdpa baseline for random weights, so it decided nothing. This version:

- adds ``paged|sdpa`` with graphs on as the baseline: how many greedy tokens two correct
  attentions share on random weights;
- counts non-finite values in the LM head's output with a forward hook (eager forwards only: a
  CUDA graph replay runs no Python hook; the count says how many eager calls it saw);
- runs workload W as phase 1 does (the canonical LoRA adapter, GRPO sampling, the same prompts):
  a NaN there raises in the sampler, which the probe reports per configuration.

Run on the device with the fa4, notebooks and tokenizer sets staged (``scripts/device/
step_table.py``: f4a, then step ``f4p``): ``python3 scripts/device/fa4_probe.py [--shapes
small,w]`` (~2-3 min for both). Needs CUDA, FA4 and the Qwen3 tokenizer (``python -m nbhelpers
fetch``). Prints one line per (shape, attention, graphs), each configuration in its own process
(``--one``), its token ids in ``$OUT/fa4_probe_<shape>_<attn>_<graphs>.tokens.json``; exits 1 if
any configuration failed. Read the lines in the step's log, not only a call's output tail
(session 18 lost them to ``| tail``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any

from probe_log import say

CONFIGS = (("paged|sdpa", False), ("paged|sdpa", True), ("paged|flash_attention_4", False),
           ("paged|flash_attention_4", True))
"""(attention, CUDA graphs) per run; the first is every shape's token reference."""
SPLIT_CONFIGS = (("paged|flash_attention_4", (True, False)),
                 ("paged|flash_attention_4", (False, True)))
"""``--split``: FA4 with CUDA graphs on one of transformers' two CB paths only ((varlen, decode),
``nbhelpers.backends.hf_cb.cuda_graph_setting``): which path's replay gives the NaN (H100,
2026-12-07: graphs on both paths died in the sampler at workload W, graphs off finished)."""


def graphs_arg(graphs: bool | tuple[bool, bool]) -> str:
    """The child's GRAPHS argument: ``0``, ``1``, or ``10`` / ``01`` for a (varlen, decode) pair."""
    if isinstance(graphs, tuple):
        return "".join(str(int(g)) for g in graphs)
    return str(int(graphs))


def parse_graphs(arg: str) -> bool | tuple[bool, bool]:
    """Inverse of :func:`graphs_arg`."""
    if arg in ("0", "1"):
        return arg == "1"
    if len(arg) == 2 and set(arg) <= {"0", "1"}:
        return (arg[0] == "1", arg[1] == "1")
    raise ValueError(f"GRAPHS {arg!r}: use 0, 1, 10 or 01")


class NonFinite:
    """Forward hook on the LM head: eager calls seen and calls with a non-finite logit."""

    def __init__(self) -> None:
        self.calls = 0
        self.bad = 0
        self.captured = 0

    def __call__(self, module: Any, args: Any, out: Any) -> None:
        import torch
        if out.is_cuda and torch.cuda.is_current_stream_capturing():
            # Reading the logits back syncs the stream, which a CUDA graph capture forbids: the
            # first version failed every graphs=True configuration this way (H100, 2026-12-07,
            # "beginAllocateToPool: already recording to mempool_id" once the failed capture was
            # retried). A captured forward is counted and left alone.
            self.captured += 1
            return
        self.calls += 1
        if not bool(torch.isfinite(out).all()):
            self.bad += 1


def _shape(name: str) -> tuple[list[list[int]], Any, Any]:
    """``(prompts, sampling, lora)`` of the small greedy shape or of workload W."""
    from nbhelpers.config import WORKLOAD_W, LoraSpec, SamplingParams
    if name == "small":
        prompts = [[100 + i + j for j in range(150)] for i in range(8)]
        return prompts, SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True), None
    from nbhelpers.bench.rollout import prepare_prompts
    return (prepare_prompts("qwen3-4b", WORKLOAD_W), WORKLOAD_W.sampling_params(),
            LoraSpec(rank=32, alpha=64))


def _say(line: str, out_dir: str) -> None:
    """Print ``line`` and append it to ``<out_dir>/fa4_probe.log`` (:func:`probe_log.say`)."""
    say(line, out_dir, "fa4_probe.log")


def run_one(name: str, attn: str, graphs: bool | tuple[bool, bool], tokens_out: str) -> int:
    """One configuration in this process; writes its token ids (JSON) to ``tokens_out`` and prints
    its line; returns 1 on failure."""
    from nbhelpers.backends import get_backend
    from nbhelpers.config import ModelSpec
    spec = ModelSpec("qwen3-4b", kind="random", dtype="bfloat16")
    prompts, sampling, lora = _shape(name)
    adapter = None
    if lora is not None:
        from nbhelpers.adapters import canonical_adapter
        adapter = str(canonical_adapter("qwen3-4b", lora))
    b = get_backend("hf_cb")
    hook = NonFinite()
    t0 = time.perf_counter()
    head = f"[{name}] {attn} graphs={graphs}:"
    try:
        opts = {**b.default_options, "attn_implementation": attn, "use_cuda_graph": graphs}
        if adapter:
            opts["adapter_path"] = adapter
        b.load(spec, lora, **opts)
        b.model.get_output_embeddings().register_forward_hook(hook)
        b.size_for_workload(prompts, sampling)
        toks = [list(o.token_ids) for o in b.generate(prompts, sampling)]
        with open(tokens_out, "w") as fh:
            json.dump(toks, fh)
        lens = sorted({len(t) for t in toks})
        _say(f"{head} ok, lengths {lens}, LM head: {hook.bad} of {hook.calls} eager calls with a "
             f"non-finite logit ({hook.captured} captured), {time.perf_counter() - t0:.1f} s",
             os.path.dirname(tokens_out))
        return 0
    except Exception as err:  # noqa: BLE001 (a probe: report every configuration)
        _say(f"{head} FAILED {err!r:.400} (LM head: {hook.bad} of {hook.calls} eager calls "
             f"non-finite), {time.perf_counter() - t0:.1f} s", os.path.dirname(tokens_out))
        traceback.print_exc()
        return 1
    finally:
        b.close()


def run_shape(name: str, out_dir: str, configs: tuple = CONFIGS) -> int:
    """Every configuration of :data:`CONFIGS` at shape ``name``, each in its own process (on the
    H100, 2026-12-07, one in-process sequence died loading the next model with "Offset increment
    outside graph capture encountered unexpectedly": a CUDA-graph configuration had left the RNG
    in capture state); token agreement against the first configuration. Returns the failures."""
    ref, bad = None, 0
    for attn, graphs in configs:
        mode = ({"10": "graphs_varlen", "01": "graphs_decode"}[graphs_arg(graphs)]
                if isinstance(graphs, tuple) else "graphs" if graphs else "eager")
        tag = f"{name}_{attn.replace('|', '_')}_{mode}"
        toks_path = os.path.join(os.path.abspath(out_dir), f"fa4_probe_{tag}.tokens.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--one", name, attn, graphs_arg(graphs),
               toks_path]
        rc = subprocess.run(cmd, check=False).returncode
        if rc != 0 or not os.path.exists(toks_path):
            bad += 1
            _say(f"[{name}] {attn} graphs={graphs}: child rc {rc}", out_dir)
            continue
        with open(toks_path) as fh:
            toks = json.load(fh)
        ref = toks if ref is None else ref
        same = sum(x == y for a, r in zip(toks, ref) for x, y in zip(a, r))
        note = " (sampled with GRPO settings: agreement is not expected)" if name == "w" else ""
        _say(f"[{name}] {attn} graphs={graphs}: {same} of {sum(map(len, ref))} tokens equal the "
             f"first configuration's{note}", out_dir)
    return bad


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="small,w",
                    help="comma list of small (8 x 150 tokens, 64 greedy, no LoRA) and w "
                         "(phase 1's workload W with LoRA r32 and GRPO sampling)")
    ap.add_argument("--one", nargs=4, metavar=("SHAPE", "ATTN", "GRAPHS", "TOKENS_JSON"),
                    help="internal: run one configuration in this process")
    ap.add_argument("--split", action="store_true",
                    help="also FA4 with CUDA graphs on the varlen path only and on the decode "
                         "path only (transformers' (varlen, decode) pair)")
    ap.add_argument("--only-split", action="store_true",
                    help="run only paged|sdpa eager (the reference) and the two split configs")
    ap.add_argument("--out", default=None, help="folder for the token files (default: $OUT or .)")
    args = ap.parse_args(argv)
    if args.one:
        name, attn, graphs, toks = args.one
        return run_one(name, attn, parse_graphs(graphs), toks)
    out_dir = args.out or os.environ.get("OUT") or "."
    os.makedirs(out_dir, exist_ok=True)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(shapes) - {"small", "w"})
    if unknown or not shapes:
        ap.error(f"--shapes {args.shapes!r}: use small, w or small,w")
    configs = (CONFIGS[:1] + SPLIT_CONFIGS if args.only_split
               else CONFIGS + SPLIT_CONFIGS if args.split else CONFIGS)
    return 1 if sum(run_shape(s, out_dir, configs) for s in shapes) else 0


if __name__ == "__main__":
    sys.exit(main())
