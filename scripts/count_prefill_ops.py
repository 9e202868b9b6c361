"""Count the aten ops (the CPU proxy for CUDA launches) of one flex-engine prefill, by origin.

The model has Qwen3-4B's structure (36 layers, 32 q / 8 kv heads, head_dim 128) with a small
hidden size and vocab (op counts do not depend on them), a bf16 base and PEFT LoRA r32 with fp32
adapters on all 7 projections (TRL's GRPO setup), and CUDA's defaults where they apply on the CPU:
``lora_dtype="model"``, page 128, prefill padded to ``prefill_pad``, flex prefill. Every aten call
is counted under a ``TorchDispatchMode`` except pure view/metadata ops (as
``nbhelpers.bench.profile.count_decode_ops``); flex_attention and the LoRA-B Triton expand count as
one op per call (one kernel each on CUDA). ``torch.tensor(..., device=dev)`` host lists are
counted as ``h2d`` (one copy each on CUDA).

Run::

    OMP_NUM_THREADS=1 python scripts/count_prefill_ops.py [--prompt-len 150] [--n 4] [--layers 36]
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

from nbhelpers.config import SamplingParams

VIEW_OPS = frozenset({"view", "_unsafe_view", "reshape", "transpose", "t", "unsqueeze", "squeeze",
                      "expand", "slice", "select", "split", "split_with_sizes", "as_strided",
                      "alias", "detach", "permute", "unbind", "narrow", "lift_fresh", "view_as"})
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model_4b_shape(layers: int, hidden: int, vocab: int) -> torch.nn.Module:
    """Qwen3 with the 4B's layer count and head geometry, bf16, PEFT LoRA r32 fp32 adapters."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, max_position_embeddings=4096, rope_theta=1e6,
                      tie_word_embeddings=True, eos_token_id=vocab - 1)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    cfg.architectures = ["Qwen3ForCausalLM"]
    lora = LoraConfig(r=32, lora_alpha=64, target_modules=TARGETS, init_lora_weights=False)
    return get_peft_model(model, lora).eval()  # autocast_adapter_dtype=True: fp32 adapters


class Counter:
    """Aten op counts keyed by (region, op); ``region`` is the innermost open :meth:`region`."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        self.counts: dict[tuple[str, str], int] = {}
        self.stack = ["other"]
        self.active = False
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func.overloadpacket.__name__
                if name not in VIEW_OPS and not (name == "to" and args and out is args[0]):
                    counter.add(name)
                return out
        self.mode = Mode()

    def add(self, name: str) -> None:
        if not self.active:
            return
        top = self.stack[1] if len(self.stack) > 1 else "other"
        key = (f"{top}/{self.stack[-1]}", name)
        self.counts[key] = self.counts.get(key, 0) + 1

    @contextlib.contextmanager
    def region(self, name: str):
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()

    def wrap(self, obj, attr: str, name: str, as_one: bool = False) -> None:
        """Count ``obj.attr(...)`` calls under region ``name`` (as one op when ``as_one``)."""
        from torch.utils._python_dispatch import _disable_current_modes
        fn = getattr(obj, attr)

        def call(*a, **k):
            with self.region(name):
                if not as_one:
                    return fn(*a, **k)
                self.add(attr)
                with _disable_current_modes():
                    return fn(*a, **k)
        setattr(obj, attr, call)

    def by_region(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (r, _), n in self.counts.items():
            out[r] = out.get(r, 0) + n
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def top(self, k: int = 25) -> list[tuple[str, str, int]]:
        return [(r, o, n) for (r, o), n in sorted(self.counts.items(), key=lambda kv: -kv[1])[:k]]


class FakeExpand:
    """Stands in for ``kernels.lora_expand`` (one Triton launch per group on CUDA): same math
    (the ``addmm_`` path), counted as one op."""

    def __init__(self, counter: Counter):
        self.counter = counter

    @staticmethod
    def supported(*a) -> bool:
        return True

    def lora_expand(self, y, xa, bs, sizes, ranks, scaling) -> None:
        from torch.utils._python_dispatch import _disable_current_modes
        self.counter.add("lora_expand(triton)")
        with _disable_current_modes():
            for y_i, xa_i, b_i in zip(y.split(sizes, -1), xa.split(ranks, -1), bs):
                y_i.addmm_(xa_i, b_i.t(), alpha=scaling)


def instrument(llm, counter: Counter) -> None:
    """Regions over the runner's prefill pieces and the model's per-layer pieces."""
    import nbhelpers.engine.layers as layers_mod
    import nbhelpers.engine.model_runner as mr
    runner, m = llm.runner, llm.runner.model
    for attr in ("refresh_weights", "_prefill_run", "_fork", "_sample"):
        counter.wrap(runner, attr, attr)
    for attr, name in (("pack_prefill", "pack_prefill"),
                       ("prefill_attention_batch", "mask_build")):
        fn = getattr(mr, attr)
        setattr(mr, attr, _in_region(counter, name, fn))
    m.flex = _as_one(counter, "flex_attention", m.flex)
    names = {}
    for group_name in ("qkv", "o", "gate_up", "down"):
        for g in getattr(m, group_name):
            g._expand = FakeExpand(counter) if g._expand is None else g._expand
            names[id(g)] = f"proj:{group_name}"
    project = m._project

    def counted_project(fx, group, x):
        with counter.region(names[id(group)]):
            return project(fx, group, x)
    m._project = counted_project
    for name in ("rms_norm", "add_rms_norm", "qk_norm_rope", "silu_mul"):
        counter.wrap(m.fx_eager, name, f"elementwise:{name}")
    if m.fx_prefill is not m.fx_eager:  # prefill_elementwise="triton": one launch a piece
        for name in ("rms_norm", "add_rms_norm", "silu_mul", "qk_rope_cache"):
            counter.wrap(m.fx_prefill, name, f"triton:{name}", as_one=True)
    counter.wrap(m, "logits", "lm_head")
    counter.wrap(m.embed, "forward", "embed")
    counter.wrap(m.rotary, "forward", "rotary_cos_sin")
    _ = layers_mod


def _in_region(counter: Counter, name: str, fn):
    def call(*a, **k):
        with counter.region(name):
            return fn(*a, **k)
    return call


def _as_one(counter: Counter, name: str, fn):
    from torch.utils._python_dispatch import _disable_current_modes

    def call(*a, **k):
        with counter.region(name):
            counter.add(name)
            with _disable_current_modes():
                return fn(*a, **k)
    return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=150)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lora-dtype", default="model")
    ap.add_argument("--steps", type=int, default=2, help="new tokens (1 = prefill only)")
    ap.add_argument("--prefill-elementwise", default="off", help="off | triton (needs "
                    "TRITON_INTERPRET=1 on the CPU; each Triton piece counts as one op; slow: "
                    "2 layers did not finish in 600 s on 2 shared cores)")
    args = ap.parse_args()
    from nbhelpers.engine import LLM
    torch.set_num_threads(1)
    vocab = 512
    model = model_4b_shape(args.layers, args.hidden, vocab)
    llm = LLM(model, page_size=128, num_pages=16, max_model_len=512, prefill_attention="flex",
              decode_attention="flex", lora_dtype=args.lora_dtype, lora_expand="addmm",
              compile_attention=False, use_cuda_graphs=False,
              prefill_elementwise=args.prefill_elementwise)
    llm.runner.pad_prefill = True  # as on CUDA (padded to prefill_pad)
    counter = Counter()
    instrument(llm, counter)
    prompt = torch.randint(0, vocab - 1, (args.prompt_len,)).tolist()
    sp = SamplingParams(temperature=1.0, min_p=0.1, n=args.n, max_new_tokens=args.steps,
                        ignore_eos=True, seed=0)
    llm.generate([prompt], sp)  # warm: fuse/shadow built (uncounted)
    with torch.no_grad():  # an optimizer step: every adapter changed in place
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(1.0)
    counter.wrap(llm.runner, "prefill", "prefill")
    counter.wrap(llm.runner, "decode", "decode")
    counter.active = True
    with torch.inference_mode(), counter.mode:
        llm.generate([prompt], sp)
    counter.active = False
    by_region = counter.by_region()
    totals = {top: sum(n for r, n in by_region.items() if r.startswith(top + "/"))
              for top in ("prefill", "decode")}
    print(json.dumps({"totals": totals, "by_region": by_region}, indent=1))
    for r, o, n in counter.top(40):
        print(f"{n:6d}  {r:45s} {o}")


if __name__ == "__main__":
    main()
