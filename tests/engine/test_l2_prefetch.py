"""L2 prefetch of o_proj weights (runner option ``l2_prefetch``, ``engine/l2_prefetch.py``): the
kernel's scratch words under ``TRITON_INTERPRET=1`` are the exact XOR of the bytes each program
read (so every load happened), its sm_90 PTX has the L2 ``evict_last`` loads and no PDL, the
option's values and resolution, and the routing on the CPU (prefetch after each layer's qkv GEMM,
joined before its o_proj GEMM, decode steps only, the buffer o_proj reads; ``"o_proj"`` on the
CPU is a no-op with the same tokens). GPU parity under CUDA graphs: ``test_l2_prefetch_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="the prefetch kernel needs the triton package")

from _kernels import DEV, assert_compiles_for_sm90, peft_tiny, skip_unless_runnable
from _tiny import random_prompts, tiny_model

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM
from nbhelpers.engine import l2_prefetch as l2
from nbhelpers.engine.kernels import fused_norm
from nbhelpers.engine.kernels import l2_prefetch as kern
from nbhelpers.engine.lora import LiveGroup
from nbhelpers.engine.runner_options import RunnerOptions
from nbhelpers.engine.runner_resolve import resolve_l2_prefetch

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
SMALL = {"page_size": 64, "num_pages": 8, "max_model_len": 64}
CUDA = torch.device("cuda")


def _expected(t: torch.Tensor, programs: int, block: int) -> np.ndarray:
    """Per program ``p``: XOR of the words of blocks ``p, p + programs, ...`` (uint8 words
    zero-extended), as the kernel's docstring says it reads them."""
    w = kern.words(t).cpu().numpy().astype(np.int64)
    owner = (np.arange(w.size) // block) % programs
    out = [np.bitwise_xor.reduce(w[owner == p]) if (owner == p).any() else 0
           for p in range(programs)]
    return np.array(out, dtype=np.int64).astype(np.uint32).view(np.int32)


@pytest.mark.parametrize(("shape", "dtype", "programs", "block"), [
    ((37, 100), torch.bfloat16, 3, 64),     # int32 words, several blocks a program
    ((5, 7), torch.bfloat16, 4, 64),        # 70 bytes: uint8 words, one partial block
    ((300,), torch.float32, 8, 16),         # more blocks than programs, last one partial
    ((3, kern.BLOCK), torch.bfloat16, 2, kern.BLOCK),  # the default block: 1.5 blocks in all
])
def test_scratch_is_the_xor_of_every_byte(shape, dtype, programs, block):
    skip_unless_runnable(fused_norm)
    torch.manual_seed(0)
    t = torch.randn(shape, dtype=torch.float32).to(dtype).to(DEV)
    scratch = torch.full((programs,), -1, dtype=torch.int32, device=DEV)
    kern.l2_prefetch(t, scratch, block=block)
    assert np.array_equal(scratch.cpu().numpy(), _expected(t, programs, block))
    t.view(-1)[0] += 1  # one changed byte changes its program's word
    again = scratch.clone()
    kern.l2_prefetch(t, again, block=block)
    assert not torch.equal(again, scratch)
    assert np.array_equal(again.cpu().numpy(), _expected(t, programs, block))


def test_bad_operands_are_refused():
    t = torch.zeros(8, 8, device=DEV)
    with pytest.raises(ValueError, match="not contiguous"):
        kern.words(t.t())
    with pytest.raises(ValueError, match="scratch must be int32"):
        kern.l2_prefetch(t, torch.zeros(4, dtype=torch.int64, device=DEV))
    assert kern.words(torch.zeros(3, dtype=torch.uint8)).dtype == torch.uint8
    assert kern.words(torch.zeros(2, dtype=torch.bfloat16)).dtype == torch.int32


_AOT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nbhelpers.engine.kernels import l2_prefetch as lp
k = lp._l2_prefetch_kernel
attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}  # as a launch specialises them
for dt in ("*i32", "*u8"):  # 16-byte vectors either way once aligned
    sig = {"src_ptr": dt, "scratch_ptr": "*i32", "n_words": "i32", "BLOCK": "constexpr"}
    src = ASTSource(k, signature=sig, attrs=attrs, constexprs={(3,): lp.BLOCK})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": lp.NUM_WARPS}).asm["ptx"]
    loads = [ln for ln in ptx.splitlines() if "ld.global" in ln]
    assert "createpolicy.fractional.L2::evict_last" in ptx, dt
    assert loads and all("L2::cache_hint" in ln and "evict_last" in ln for ln in loads), loads
    assert any(".v4.b32" in ln for ln in loads), (dt, loads[:2])
    assert "griddepcontrol" not in ptx, dt  # never a PDL kernel
print("compiled")
"""


def test_ptx_has_l2_evict_last_loads_for_sm90():
    """sm_90 build: one ``createpolicy ... L2::evict_last`` policy, every global load carries
    it (``L2::cache_hint``), 16-byte ``v4.b32`` loads for aligned int32 and uint8 words, no
    ``griddepcontrol``."""
    assert_compiles_for_sm90(_AOT)


def test_option_values_default_off_and_errors():
    assert RunnerOptions().l2_prefetch == "off"
    assert RunnerOptions(l2_prefetch="o_proj").l2_prefetch == "o_proj"
    with pytest.raises(ValueError, match=r"l2_prefetch='on'.*\('off', 'o_proj'\)"):
        RunnerOptions(l2_prefetch="on")
    with pytest.raises(ValueError, match=r"\('off', 'o_proj'\)"):
        l2.L2Prefetch("all", None)
    with pytest.raises(ValueError, match="l2_prefetch"):
        LLM(tiny_model("qwen3").to(DEV), l2_prefetch=True, **SMALL)


def test_resolution_cuda_only(monkeypatch):
    """``"o_proj"`` stays on for CUDA with compiled Triton, else ``"off"``: the CPU, the
    interpreter, ``compile_decode``."""
    from nbhelpers.engine.kernels import pdl
    on = RunnerOptions(l2_prefetch="o_proj")
    assert resolve_l2_prefetch(on, torch.device("cpu")) == "off"
    monkeypatch.setattr(pdl, "interpreted", lambda: False)
    assert resolve_l2_prefetch(on, CUDA) == "o_proj"
    assert resolve_l2_prefetch(RunnerOptions(), CUDA) == "off"
    assert resolve_l2_prefetch(RunnerOptions(l2_prefetch="o_proj", compile_decode=True),
                               CUDA) == "off"
    monkeypatch.setattr(pdl, "interpreted", lambda: True)
    assert resolve_l2_prefetch(on, CUDA) == "off"


@pytest.mark.skipif(DEV != "cpu", reason="the CPU no-op; CUDA: test_l2_prefetch_gpu.py")
def test_cpu_o_proj_is_a_no_op_with_the_same_tokens():
    model = tiny_model("qwen3")
    prompts = random_prompts(3, 5, 12, seed=1)
    llm = LLM(model, l2_prefetch="o_proj", **SMALL)
    assert llm.runner.l2 is llm.runner.model.l2 and not llm.runner.l2.enabled
    got = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, GREEDY)]
    want = [(o.token_ids, o.logprobs) for o in LLM(model, **SMALL).generate(prompts, GREEDY)]
    assert got == want and llm.runner.l2.launches == 0


def _record(monkeypatch, llm) -> list[tuple]:
    """Force ``llm``'s prefetch on with the launch and the join's wait recorded (no CUDA), and
    every projection GEMM recorded: events ``("gemm", group)``, ``("launch", ptr)``,
    ``("wait",)`` in call order."""
    events: list[tuple] = []
    pf = llm.runner.l2
    pf.enabled = True
    monkeypatch.setattr(pf, "_launch", lambda w: (events.append(("launch", w.data_ptr())),
                                                  setattr(pf, "_side", "side")))
    monkeypatch.setattr(pf, "_wait", lambda side: events.append(("wait", side)))
    real = LiveGroup.__call__
    monkeypatch.setattr(LiveGroup, "__call__",
                        lambda self, x: (events.append(("gemm", self)), real(self, x))[1])
    return events


@pytest.mark.parametrize("lora", [False, True])
def test_routing_fork_after_qkv_join_before_o_proj_decode_only(monkeypatch, lora):
    """Each decode step, each layer: qkv GEMM, the prefetch of that layer's o_proj buffer (the
    ``[W; A]`` ``ext`` buffer with LoRA), the join, then the o_proj GEMM; prefill: none."""
    model = peft_tiny(torch.float32) if lora else tiny_model("qwen3")
    # the expand path (lora_expand="consumer", the CUDA default since 2026-12-02, records the
    # qkv group's GEMM through its deferral; its routing with the prefetch is not checked here)
    llm = LLM(model, l2_prefetch="o_proj", use_cuda_graphs=False, lora_expand="triton", **SMALL)
    em = llm.runner.model
    events = _record(monkeypatch, llm)
    prefill_done: list[int] = []
    real_prefill = llm.runner.prefill
    monkeypatch.setattr(llm.runner, "prefill", lambda *a: (real_prefill(*a),
                                                           prefill_done.append(len(events))))
    llm.generate(random_prompts(2, 5, 9, seed=3), GREEDY)
    assert prefill_done and not any(e[0] == "launch" for e in events[:prefill_done[0]])
    steps = llm.runner.timings["decode_steps"]
    launches = [j for j, e in enumerate(events) if e[0] == "launch"]
    assert steps > 0 and len(launches) == steps * len(em.layers) == llm.runner.l2.launches
    for n, j in enumerate(launches):
        i = n % len(em.layers)
        o_weight = em.o[i].gemm_weight()
        assert events[j] == ("launch", o_weight.data_ptr())
        assert o_weight.shape[0] == model.config.hidden_size + (4 if lora else 0)
        assert events[j - 1] == ("gemm", em.qkv[i])
        assert events[j + 1] == ("wait", "side") and events[j + 2] == ("gemm", em.o[i])


def test_off_routes_nothing(monkeypatch):
    llm = LLM(tiny_model("qwen3"), use_cuda_graphs=False, **SMALL)
    assert llm.runner.l2.mode == "off" and not llm.runner.l2.enabled
    events = _record(monkeypatch, llm)
    llm.runner.l2.enabled = False  # "off": decoding() never activates the forks
    llm.generate(random_prompts(2, 5, 9, seed=3), GREEDY)
    assert not any(e[0] in ("launch", "wait") for e in events)
