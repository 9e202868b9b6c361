"""``pdl="prefetch"`` (``engine/kernels/pdl.py``, last section): the option, its budget
``pdl_prefetch_mib`` (their resolution: ``test_pdl_early.py``); the launch kwargs (``EARLY_TRIGGER``, the skinny GEMM's
``PREFETCH`` tiles); in Triton's interpreter with the PDL instructions stubbed, every
``EARLY_TRIGGER`` kernel lets its dependents launch before its wait with bit-identical outputs,
and the skinny GEMM's prefetch addresses are exactly the next tiles of each program's W slice;
the sm_90 PTX (trigger before the wait, ``prefetch.global.L2`` before it); on a Hopper GPU the
engine's greedy tokens and logprobs equal ``pdl="early"`` under CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the PDL kernels need the triton package")

from _kernels import DEV, assert_compiles_for_sm90, peft_tiny
from _tiny import random_prompts
from test_pdl import (
    GREEDY,
    KERNEL_OPTS,
    _force_skinny,
    _spy,
    assert_same_greedy,
    greedy_per_mode,
)

from nbhelpers.engine import LLM
from nbhelpers.engine.kernels import pdl
from nbhelpers.engine.kernels import skinny_gemm as sg
from nbhelpers.engine.runner_options import RunnerOptions

INTERP = pytest.mark.skipif(DEV != "cpu", reason="runs the EARLY_TRIGGER / PREFETCH branches in "
                            "the interpreter; CUDA: test_gpu_prefetch_matches_early (H200 suite)")


@pytest.fixture
def order(monkeypatch) -> list[str]:
    """``gdc_wait`` / ``gdc_launch_dependents`` stubbed to append ``"wait"`` / ``"launch"`` in
    call order (the interpreter runs programs one after another), the interpreter check off so
    :func:`pdl.scope` turns on."""
    import triton.language as tl
    seq: list[str] = []
    monkeypatch.setattr(tl.extra.cuda, "gdc_wait", lambda: seq.append("wait"))
    monkeypatch.setattr(tl.extra.cuda, "gdc_launch_dependents", lambda: seq.append("launch"))
    monkeypatch.setattr(pdl, "interpreted", lambda: False)
    return seq


# ------------------------------------------------------------------------------ options

def test_option_and_budget_values():
    assert RunnerOptions(pdl="prefetch").pdl == "prefetch"
    assert RunnerOptions().pdl_prefetch_mib == 8  # the least slow budget of the H200 A/B
    assert RunnerOptions(pdl_prefetch_mib=0).pdl_prefetch_mib == 0
    for bad in (-1, 1.5, True, 2048, "16"):
        with pytest.raises(ValueError, match=r"pdl_prefetch_mib=.*int in \[0, 1024\]"):
            RunnerOptions(pdl_prefetch_mib=bad)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="budget_bytes=.*int >= 0"), \
                pdl.scope("prefetch", bad):
            pass


def test_scope_prefetch_sets_trigger_and_budget(monkeypatch):
    assert pdl.launch_kwargs(trigger=True) == {"USE_GDC": False, "EARLY_TRIGGER": False}
    monkeypatch.setattr(pdl, "interpreted", lambda: False)
    on = {"USE_GDC": True, "launch_pdl": True}
    with pdl.scope("prefetch", 3 << 20):
        assert pdl.early() and pdl.prefetch_bytes() == 3 << 20
        assert pdl.launch_kwargs() == on  # launchers without the new keys: unchanged
        assert pdl.launch_kwargs(prewait=True, trigger=True) == {
            **on, "PREWAIT": True, "EARLY_TRIGGER": True}
        with pdl.scope("early"):
            assert pdl.launch_kwargs(trigger=True) == {**on, "EARLY_TRIGGER": False}
            assert pdl.prefetch_bytes() == 0
        assert pdl.prefetch_bytes() == 3 << 20
    with pdl.scope("prefetch", 0):  # the early launches without the prefetch
        assert pdl.launch_kwargs(trigger=True)["EARLY_TRIGGER"] and pdl.prefetch_bytes() == 0
    assert pdl.prefetch_bytes() == 0 and not pdl.active()
    monkeypatch.setattr(pdl, "interpreted", lambda: True)
    with pdl.scope("prefetch"):  # the interpreter: off
        assert pdl.launch_kwargs(trigger=True) == {"USE_GDC": False, "EARLY_TRIGGER": False}
        assert pdl.prefetch_bytes() == 0


def test_prefetch_tiles_splits_the_budget():
    """The docstring's o_proj example, the budget's edges, the split's own tiles and the cap;
    Qwen3-4B's lm_head (1,187 programs of 32 KiB tiles) gets none from 16 MiB."""
    mib = 1 << 20
    o_cfg = sg.Config(128, 128, 4)
    assert sg.prefetch_tiles(2592, 4096, o_cfg, 2, 16 * mib) == 6
    assert sg.prefetch_tiles(2592, 4096, o_cfg, 2, 0) == 0
    assert sg.prefetch_tiles(2592, 4096, o_cfg, 2, 1024 * mib) == 7  # the split's 8 tiles - 1
    assert sg.prefetch_tiles(2592, 40960, sg.Config(128, 128, 1), 2, 1024 * mib) == \
        sg.MAX_PREFETCH_TILES
    assert sg.prefetch_tiles(151936, 2560, sg.Config(128, 128, 1), 2, 16 * mib) == 0
    assert sg.prefetch_tiles(19520, 2560, sg.Config(64, 128, 1), 2, 16 * mib) == 3  # gate_up
    assert sg.prefetch_tiles(64, 128, sg.Config(64, 128, 1), 4, 16 * mib) == 0  # one K tile


# ------------------------------------------------------------------------------ interpreter

def _per_program(seq: list[str]) -> list[tuple[str, str]]:
    assert len(seq) % 2 == 0, seq
    return [tuple(seq[i:i + 2]) for i in range(0, len(seq), 2)]


def _early_vs_prefetch(run, order: list[str]) -> None:
    """``run()`` under ``scope("early")`` and ``scope("prefetch")``: bit-identical outputs, one
    wait and one trigger per program, the trigger after the wait in ``"early"`` and before it
    in ``"prefetch"``."""
    outs = {}
    for mode, first in (("early", "wait"), ("prefetch", "launch")):
        order.clear()
        with pdl.scope(mode):
            outs[mode] = [t.clone() for t in run()]
        pairs = _per_program(order)
        assert pairs and all(p[0] == first and set(p) == {"wait", "launch"} for p in pairs), \
            (mode, pairs[:4])
    for a, b in zip(outs["early"], outs["prefetch"]):
        assert a.dtype == b.dtype and torch.equal(a, b)


@INTERP
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_norm_and_act_mul_trigger_first(order, dtype):
    from test_fused_kernels import _randn

    from nbhelpers.engine.kernels import fused_norm as fn
    rows, n = 3, 96
    x, h = _randn(rows, n, dtype=dtype), _randn(rows, n, dtype=dtype, seed=1, scale=3.0)
    w = _randn(n, dtype=dtype, seed=2)
    _early_vs_prefetch(lambda: list(fn.add_norm(h, x=x, out_norm=(w, 1e-6, "llama"))), order)
    g, u = _randn(rows, n, dtype=dtype, seed=4), _randn(rows, n, dtype=dtype, seed=5)
    _early_vs_prefetch(lambda: [fn.act_mul(g, u)], order)


@INTERP
def test_act_mul_lora_triggers_first(order):
    from test_lora_consumer import _pending

    from nbhelpers.engine import fused

    def run():
        p = _pending([96, 96], [8, 16], 3, torch.bfloat16, torch.float32, seed=1)
        gate, up = p.y.view(1, 3, 192).split(96, -1)
        return (fused.triton_silu_mul(gate, up, lora=p),)
    _early_vs_prefetch(run, order)


@INTERP
@pytest.mark.parametrize("kernel,splits", [("v1", 3), ("v2", 1)], ids=["two_stages", "direct"])
def test_paged_decode_stages_trigger_first(order, kernel, splits):
    """Stage 1 and stage 2 (two stages), and stage 1 alone when it writes the output."""
    from nbhelpers.engine.kernels.paged_decode_kernel import paged_decode_attention
    g = torch.Generator().manual_seed(0)
    bsz, heads, kv_heads, dim, page, pages = 2, 4, 2, 32, 16, 6
    q = torch.randn(bsz, heads, dim, generator=g)
    k = torch.randn(1, kv_heads, pages * page, dim, generator=g)
    v = torch.randn(1, kv_heads, pages * page, dim, generator=g)
    table = torch.tensor([[0, 2, 4], [1, 3, 5]])
    lens = torch.tensor([40, 17])
    _early_vs_prefetch(lambda: [paged_decode_attention(
        q, k, v, table, lens, dim ** -0.5, page, splits, kernel=kernel)], order)


def _fake_prefetch(monkeypatch, order: list[str]) -> list[list[int]]:
    """``_prefetch_l2`` replaced by a Python stand-in that records each call's addresses (the
    interpreter's int64 pointer tensor) and appends ``"prefetch"`` to ``order``."""
    seen: list[list[int]] = []

    def fake(ptrs):
        seen.append(ptrs.handle.data.reshape(-1).tolist())
        order.append("prefetch")
    monkeypatch.setattr(sg, "_prefetch_l2", fake)
    return seen


@INTERP
@pytest.mark.parametrize("pf", [2, 5], ids=["inside_the_split", "past_the_split"])
def test_skinny_gemm_prefetches_the_next_tiles_of_each_slice(monkeypatch, order, pf):
    """``PREFETCH=P``: the addresses of each prefetch call are the 128-byte lines of one K tile
    of one program's slice (rows of its N tile inside W, columns inside its split), the rest
    pointed at W's first element; each program prefetches tiles 1..P of its split (those that
    exist: with 4 tiles a split, P=5 prefetches 3 and points the rest at W's start), all before
    its wait; the product is bit-identical to no prefetch. Calls are matched to programs by
    their addresses, not by the interpreter's program order."""
    seen = _fake_prefetch(monkeypatch, order)
    torch.manual_seed(0)
    n, k, cfg = 80, 1024, sg.Config(32, 128, 2)  # 3 N tiles (the last partial) x 2 splits
    x, w = torch.randn(3, k), torch.randn(n, k)
    want = sg.skinny_gemm(x, w, None, cfg)
    with pdl.scope("prefetch"):
        got = sg.skinny_gemm(x, w, None, cfg, prefetch_k_tiles=pf)
    assert torch.equal(got, want)
    split, k_per = sg.launch_split(k, cfg)
    tiles_per_split = k_per // cfg.block_k
    programs = -(-n // cfg.block_n) * split
    # per program: its prefetches, then its wait, then its trigger
    per_prog = "".join({"prefetch": "p", "wait": "w", "launch": "l"}[e] for e in order)
    assert per_prog == ("p" * pf + "wl") * programs
    base, es, line = w.data_ptr(), w.element_size(), 128 // w.element_size()
    expected = {}  # (tile, split, t) -> the line addresses
    for tile in range(-(-n // cfg.block_n)):
        for sp in range(split):
            for t in range(1, pf + 1):
                lo = sp * k_per + t * cfg.block_k
                cols = range(lo, lo + cfg.block_k, line)
                expected[(tile, sp, t)] = {
                    base + (r * k + c) * es if r < n and t < tiles_per_split else base
                    for r in range(tile * cfg.block_n, (tile + 1) * cfg.block_n) for c in cols}
    got_sets = [set(a) for a in seen]
    assert len(got_sets) == len(expected)
    for key, want_set in expected.items():
        assert want_set in got_sets, key
        got_sets.remove(want_set)


def test_prefetch_arguments_are_checked():
    """``prefetch_tiles`` refuses bad sizes and budgets; ``skinny_gemm`` refuses a tile count
    outside [0, MAX_PREFETCH_TILES], a bool or float, and a prefetch with a K tile narrower than
    one 128-byte line (the kernel would build an empty line range); such a config gets 0 from
    the budget."""
    cfg = sg.Config(64, 128, 1)
    for kw in ({"n": 0}, {"k": -1}, {"elem_size": 0}, {"budget_bytes": -1},
               {"budget_bytes": 1.5}, {"n": True}):
        args = {"n": 64, "k": 512, "cfg": cfg, "elem_size": 2, "budget_bytes": 1 << 20, **kw}
        with pytest.raises(ValueError, match=r"prefetch_tiles: .* must be an int >= "):
            sg.prefetch_tiles(**args)
    narrow = sg.Config(64, 32, 1)  # 32 bf16 = 64 B < one line
    assert sg.prefetch_tiles(64, 512, narrow, 2, 1 << 30) == 0
    assert sg.prefetch_tiles(64, 512, narrow, 4, 1 << 30) == sg.MAX_PREFETCH_TILES  # fp32: 128 B
    x, w = torch.randn(2, 512, device=DEV), torch.randn(64, 512, device=DEV)
    for bad in (-1, sg.MAX_PREFETCH_TILES + 1, True, 1.5, "2"):
        with pytest.raises(ValueError, match=r"prefetch_k_tiles=.*K tiles, not bytes"):
            sg.skinny_gemm(x, w, None, cfg, prefetch_k_tiles=bad)
    with pytest.raises(ValueError, match=r"below one 128-byte line"):
        sg.skinny_gemm(x.bfloat16(), w.bfloat16(), None, narrow, prefetch_k_tiles=1)


# ------------------------------------------------------------------------------ sm_90 PTX

_AOT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nbhelpers.engine.kernels import fused_norm as fn, lora_act_mul as lam
from nbhelpers.engine.kernels import paged_decode_kernel as pk, skinny_gemm as sg
SK = dict(HAS_BIAS=False, SPLIT=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, UPCAST=False,
          BF16_RNE=False)
ST1 = dict(GROUP=4, BLOCK_H=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, PAGE_SIZE=128,
           USE_WINDOW=False, USE_SOFT_CAP=False, DOT_PRECISION="tf32", NUM_SPLITS=4,
           MIN_SPLIT_TILES=0, DIRECT=False)
I64, F32 = {"BlockTable": "*i64", "SeqLens": "*i64"}, "*fp32"
TRIGGER = {
    "add_norm": (fn._add_norm_kernel, dict(HAS_X=True, D_STYLE=0, D_W=False, HAS_SCALE=False,
                                           STORE_RES=True, O_STYLE=1, O_W=True, BLOCK=4096,
                                           HAS_LORA=False, LORA_K=4, LORA_RNE=False,
                                           PREWAIT=True), {}),
    "act_mul": (fn._act_mul_kernel, dict(ACT=0, BLOCK=1024), {}),
    "act_mul_lora": (lam._act_mul_lora_kernel, dict(ACT=0, BLOCK_M=16, BLOCK_N=64, BLOCK_R=32,
                                                    DOT_FP32=False, RNE=False, PREWAIT=True),
                     {}),
    "stage1": (pk._paged_attention_stage1, ST1, {**I64, "MidO": F32, "MidLse": F32}),
    "stage2": (pk._paged_attention_stage2, dict(HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=4,
                                                BLOCK_S=4), {"MidO": F32, "MidLse": F32}),
}
FLOATS = {"scale", "soft_cap", "scaling"}


def ptx(kern, consts, ptrs):
    if "HAS_PREFIX" in kern.arg_names:  # the shared-prefix builds: test_pdl_builds.py
        consts = {"HAS_PREFIX": False, **consts}
    sig = {a: "constexpr" if a in consts else ptrs.get(a) or (
        "fp32" if a in FLOATS or a.startswith("eps") else
        "*bf16" if a.endswith("_ptr") or a[0].isupper() else "i32") for a in kern.arg_names}
    src = ASTSource(kern, signature=sig,
                    constexprs={(kern.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4}).asm["ptx"]


for name, (kern, consts, ptrs) in TRIGGER.items():
    for early in (False, True):
        p = ptx(kern, {**consts, "USE_GDC": True, "EARLY_TRIGGER": early}, ptrs)
        wait, launch = p.find("griddepcontrol.wait"), p.find("griddepcontrol.launch_dependents")
        assert p.count("griddepcontrol.wait") == 1, name
        assert p.count("griddepcontrol.launch_dependents") == 1, name
        assert (launch < wait) if early else (launch > wait), (name, early)
sk = {"ws_ptr": F32, "cnt_ptr": "*i32"}
for pf in (0, 3):
    p = ptx(sg._skinny_gemm, {**SK, "USE_GDC": True, "PREFETCH": pf}, sk)
    wait = p.find("griddepcontrol.wait")
    n_pf = p.count("prefetch.global.L2")
    assert (n_pf > 0) if pf else n_pf == 0, (pf, n_pf)
    assert p.rfind("prefetch.global.L2") < wait, pf  # every prefetch before the wait
p = ptx(sg._skinny_gemm, {**SK, "USE_GDC": False, "PREFETCH": 3}, sk)
assert "prefetch.global" not in p and "griddepcontrol" not in p  # no PDL: no prefetch
print("compiled")
"""


def test_ptx_trigger_before_wait_and_prefetch_before_wait_for_sm90():
    """sm_90 builds: each ``EARLY_TRIGGER`` kernel has one ``launch_dependents``, after its wait
    normally and before it with ``EARLY_TRIGGER``; the skinny GEMM with ``PREFETCH=3`` issues
    ``prefetch.global.L2`` lines, all before its wait, none with ``PREFETCH=0`` or without
    PDL (the peeled branch holding them is pruned)."""
    assert_compiles_for_sm90(_AOT)


# ------------------------------------------------------------------------------ engine

@INTERP
@pytest.mark.parametrize("expand", ["triton", "consumer"])
def test_engine_prefetch_matches_off_in_the_interpreter(monkeypatch, order, expand):
    """The engine with ``pdl="prefetch"`` (the runner's switch forced on, PDL stubbed): the
    greedy tokens and logprobs of ``pdl="off"``, exactly; decode programs trigger first; the
    runner records the mode and budget."""
    from nbhelpers.engine.tuner_tables import resolved_kernels
    model = peft_tiny(torch.float32)
    prompts = random_prompts(2, 5, 9, seed=3)
    opts = {**KERNEL_OPTS, "lora_expand": expand}
    want = LLM(model, pdl="off", **opts).generate(prompts, GREEDY)
    monkeypatch.setattr(pdl, "supported", lambda device: True)
    seen = _spy(monkeypatch)
    llm = LLM(model, pdl="prefetch", pdl_prefetch_mib=4, **opts)
    got_kernels = resolved_kernels(llm.runner)
    assert (got_kernels["pdl_mode"], got_kernels["pdl_prefetch_mib"]) == ("prefetch", 4)
    order.clear()
    got = llm.generate(prompts, GREEDY)
    assert any(seen) and not all(seen)  # decode on, prefill off
    assert "launch" in order and order[0] == "launch"  # a decode program triggered first
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.logprobs == w.logprobs


def _wide_peft(dtype, autocast: bool = True):
    """A 2-layer Qwen3 wide enough to prefetch (hidden 256, intermediate 512: every decode GEMM
    spans 2-4 K tiles of 128, so ``prefetch_tiles`` > 0; the 64-wide ``peft_tiny`` fits one
    tile and never prefetches), PEFT LoRA r=4 on every projection, random A and B."""
    from _kernels import TARGETS
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=512, eos_token_id=511,
                      rope_theta=1e6, tie_word_embeddings=True)
    cfg.architectures = ["Qwen3ForCausalLM"]
    model = Qwen3ForCausalLM(cfg).to(dtype=dtype, device=DEV).eval()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    return get_peft_model(model, lora, autocast_adapter_dtype=autocast).eval()


def _launch_spy(monkeypatch) -> list[tuple]:
    """Record ``(n, k, config, element size, USE_GDC, PREFETCH)`` of every skinny GEMM launch."""
    rec: list[tuple] = []
    real = sg._skinny_gemm

    class Spy:
        def __getitem__(self, grid):
            launch = real[grid]

            def run(*args, **kw):
                cfg = sg.Config(kw["BLOCK_N"], kw["BLOCK_K"], grid[1])
                rec.append((args[7], args[8], cfg, args[1].element_size(), kw["USE_GDC"],
                            kw["PREFETCH"]))
                return launch(*args, **kw)
            return run
    monkeypatch.setattr(sg, "_skinny_gemm", Spy())
    return rec


def _check_budget(launches: list[tuple], mib: int) -> None:
    """Every PDL launch prefetched what ``prefetch_tiles`` gives for ``mib`` MiB (the option's
    MiB reach the kernel as bytes), some of them > 0; non-PDL launches none."""
    pdl_launches = [r for r in launches if r[4]]
    assert pdl_launches and any(r[5] > 0 for r in pdl_launches)
    for n, k, cfg, es, _, pf in pdl_launches:
        assert pf == sg.prefetch_tiles(n, k, cfg, es, mib << 20), (n, k, cfg, pf)
    assert all(r[5] == 0 for r in launches if not r[4])


@INTERP
def test_engine_prefetching_shapes_match_off_in_the_interpreter(monkeypatch, order):
    """The engine with ``pdl="prefetch"`` on shapes that do prefetch (the runner's switch forced
    on, PDL stubbed, ``_prefetch_l2`` a Python stand-in): greedy tokens and logprobs equal to
    ``pdl="off"``; the budget reaches every decode GEMM as ``prefetch_tiles`` of its bytes."""
    seen = _fake_prefetch(monkeypatch, order)
    monkeypatch.setattr(sg, "INTERPRETER_PREFETCH", True)
    model = _wide_peft(torch.float32)
    prompts = random_prompts(2, 5, 9, seed=3)
    want = LLM(model, pdl="off", **KERNEL_OPTS).generate(prompts, GREEDY)
    assert not seen  # no prefetch without PDL
    launches = _launch_spy(monkeypatch)
    monkeypatch.setattr(pdl, "supported", lambda device: True)
    got = LLM(model, pdl="prefetch", pdl_prefetch_mib=4, **KERNEL_OPTS).generate(prompts, GREEDY)
    assert seen
    _check_budget(launches, 4)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.logprobs == w.logprobs


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="PDL needs a CUDA GPU of compute capability >= 9 "
                    "(H100/H200); run on the H200 host")
def test_gpu_skinny_gemm_prefetch_is_exact():
    """The prefetching skinny GEMM at Qwen3-4B's o_proj / down_proj / qkv shapes, batch 4 bf16,
    every fitting config and several ``PREFETCH`` counts: bit-identical to the plain launch."""
    torch.manual_seed(0)
    for n, k in ((2592, 4096), (2592, 9728), (6240, 2560)):
        x = torch.randn(4, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        for cfg in (sg.default_config(n, k), *sg.CONFIGS):
            if not sg.fits(cfg, 2, 232448):
                continue
            want = sg.skinny_gemm(x, w, None, cfg)
            if cfg.block_k * x.element_size() < sg.LINE_BYTES:  # refused: a tile under a line
                continue
            for pf in (1, 3, sg.MAX_PREFETCH_TILES):
                with pdl.scope("prefetch"):
                    got = sg.skinny_gemm(x, w, None, cfg, prefetch_k_tiles=pf)
                assert torch.equal(got, want), (n, k, cfg, pf)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="PDL needs a CUDA GPU of compute capability >= 9 "
                    "(H100/H200); run on the H200 host")
@pytest.mark.parametrize("expand", ["triton", "consumer"])
@pytest.mark.parametrize("dtype,autocast,opts", [
    (torch.float32, False, {}), (torch.bfloat16, True, {"lora_dtype": "adapter"})],
    ids=["fp32", "bf16_fp32_adapters"])
def test_gpu_prefetch_matches_early(monkeypatch, tmp_path, dtype, autocast, opts, expand):
    """Tiny Qwen3 with LoRA r=4 under CUDA graphs: ``pdl="prefetch"`` gives the greedy tokens
    and logprobs of ``"early"`` (within 1e-6: the same loads and arithmetic, only cache hints
    and launch timing differ)."""
    monkeypatch.setenv("NBHELPERS_CACHE_DIR", str(tmp_path))
    _force_skinny(monkeypatch)
    outs = greedy_per_mode(peft_tiny(dtype, autocast), ("early", "prefetch"),
                           {**KERNEL_OPTS, "lora_expand": expand, **opts})
    assert_same_greedy(outs["prefetch"], outs["early"])


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="PDL needs a CUDA GPU of compute capability >= 9 "
                    "(H100/H200); run on the H200 host")
@pytest.mark.parametrize("dtype,autocast,opts", [
    (torch.float32, False, {}), (torch.bfloat16, True, {"lora_dtype": "adapter"})],
    ids=["fp32", "bf16_fp32_adapters"])
def test_gpu_engine_prefetches_and_matches_early(monkeypatch, tmp_path, dtype, autocast, opts):
    """A Qwen3 wide enough to prefetch, under CUDA graphs: ``pdl="prefetch"`` launches its
    decode GEMMs with ``PREFETCH`` > 0 (as ``prefetch_tiles`` gives for the budget) and gives
    the greedy tokens and logprobs of ``"early"`` (within 1e-6)."""
    monkeypatch.setenv("NBHELPERS_CACHE_DIR", str(tmp_path))
    _force_skinny(monkeypatch)
    launches = {}  # mode -> the skinny launches from that mode's run on
    outs = greedy_per_mode(_wide_peft(dtype, autocast), ("early", "prefetch"),
                           {**KERNEL_OPTS, "pdl_prefetch_mib": 2, **opts},
                           lambda mode: launches.setdefault(mode, _launch_spy(monkeypatch)))
    _check_budget(launches["prefetch"], 2)
    assert_same_greedy(outs["prefetch"], outs["early"])
