"""The split-vocabulary sampler (``engine/kernels/vocab_sample.py``, runner option
``sample_kernel``): the in-kernel hash against ``sampler.uniform_noise`` bit for bit, tokens and
logprobs against ``sampler.sample(use_sort=False, full_logprobs=True)`` (greedy rows mixed in,
fp32/bf16 logits, several chunkings), workspace reuse and counter reset, the routing, the
sampler tests' chi-square against the kernel, the PDL branches, the sm_90 build (PDL wait
first), and (GPU) Qwen3-4B's vocabulary at batch 4 and 32. The engine option:
``test_vocab_sample_engine.py``.

On the CPU the kernels run under ``TRITON_INTERPRET=1`` (``tests/conftest.py``; one interpreted
program costs ~20 ms, hence the small row counts); skipped when triton is not importable.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="vocab_sample needs the triton package")

import triton
import triton.language as tl
from _kernels import DEV, assert_compiles_for_sm90, skip_unless_runnable
from test_pdl import gdc_stubs  # noqa: F401 -- a fixture
from test_sampler import chi_square_p, reference_probs

from nbhelpers.engine import sampler
from nbhelpers.engine.kernels import pdl
from nbhelpers.engine.kernels import vocab_sample as vs
from nbhelpers.engine.kernels.vocab_sample import _uniform

skip_unless_runnable(vs)
SEEDS = torch.tensor([0, 1, -5, 3407, 2 ** 40 + 7, -(2 ** 62) + 11, 123456789012345, 2 ** 63 - 1])


@triton.jit
def _uniform_kernel(seed_ptr, gen_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row, blk = tl.program_id(0), tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    u = _uniform(tl.load(seed_ptr + row), tl.load(gen_ptr + row), offs)
    tl.store(out_ptr + row * V + offs, u, mask=offs < V)


def test_uniform_bits_equal_uniform_noise():
    """``_uniform`` (the kernel's hash) is ``uniform_noise`` bit for bit: negative seeds, seeds
    past 2^32 and 2^62, gen_idx past 2^32 (their products wrap mod 2^32 in both)."""
    seeds = SEEDS.to(DEV)
    gen = torch.tensor([0, 1, 7, 511, 2 ** 31 + 3, 2 ** 33 + 5, 10 ** 12, 42], device=DEV)
    V = 3000
    out = torch.empty(len(seeds), V, device=DEV)
    _uniform_kernel[(len(seeds), triton.cdiv(V, 1024))](seeds, gen, out, V, BLOCK=1024)
    want = sampler.uniform_noise(seeds, gen, V)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


def _inputs(B, V, dtype, seed=0, device=DEV):
    """Logits ``randn * 3`` and per-row parameters cycling greedy / T 0.7 / T 1.0 with min_p 0
    and 0.1 (row 0 greedy, so every batch has one)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, V, generator=g) * 3).to(dtype).to(device)
    temp = torch.tensor([(0.0, 0.7, 1.0)[i % 3] for i in range(B)], device=device)
    min_p = torch.tensor([(0.0, 0.1)[(i // 3) % 2] for i in range(B)], device=device)
    seeds = (torch.arange(B) * 7919 + seed * 1000003 - 17).to(device)
    gen = (torch.arange(B) * 5 + seed).to(device)
    return logits, temp, min_p, seeds, gen


def _torch(logits, temp, min_p, seeds, gen):
    B = logits.shape[0]
    off_k = torch.zeros(B, dtype=torch.long, device=logits.device)
    return sampler.sample(logits, temp, min_p, off_k, torch.ones(B, device=logits.device),
                          seeds, gen, use_sort=False, full_logprobs=True)


def _exact_logprobs(logits, temp, min_p, tok):
    """``[B, 2]`` fp64 (filtered, full) logprobs of ``tok`` by the sampler's definitions."""
    x = logits.double() / torch.where(temp > 0, temp, 1.0).double().unsqueeze(1)
    z = x - x.amax(-1, keepdim=True)
    p = z.exp()
    kept = torch.where(temp.unsqueeze(1) > 0, p >= min_p.double().unsqueeze(1), True)
    z_tok = z.gather(1, tok.unsqueeze(1)).squeeze(1)
    return torch.stack([z_tok - (p * kept).sum(-1).log(), z_tok - p.sum(-1).log()], 1)


def _assert_matches_torch(args, **kw):
    """Tokens equal to the torch sampler's; logprobs within 1e-5 of the fp64 value and of
    torch's (plus torch's own fp32 error: its softmax over 151,936 tokens was 1.2e-5 off the
    fp64 value in the interpreter case, the kernel 3.6e-7)."""
    tok, lp = vs.vocab_sample(*args, **kw)
    want_tok, want_lp = _torch(*args)
    assert tok.dtype == torch.long and lp.shape == (len(tok), 2) and lp.dtype == torch.float32
    assert torch.equal(tok, want_tok)
    exact = _exact_logprobs(args[0], args[1], args[2], tok)
    torch.testing.assert_close(lp.double(), exact, rtol=0, atol=1e-5)
    torch_err = float((want_lp.double() - exact).abs().max())
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-5 + torch_err)
    return tok, lp


@pytest.mark.parametrize("B", [1, 4, 32])
@pytest.mark.parametrize("V,chunk", [(1000, 4096), (1000, 256), (5000, 4096)],
                         ids=["v1000", "v1000_c256", "v5000"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_torch_sampler(B, V, chunk, dtype):
    """Tokens equal, logprobs within 1e-5 of the torch sampler over two seed sets; one chunk,
    four chunks with a partial last one, two chunks with a partial last one (V not a multiple
    of the chunk); greedy rows take the raw argmax."""
    for seed in (0, 1):
        args = _inputs(B, V, dtype, seed)
        tok, _ = _assert_matches_torch(args, chunk=chunk)
        greedy = args[1] <= 0
        assert torch.equal(tok[greedy], args[0].float().argmax(-1)[greedy])


def test_matches_torch_at_qwen3_vocab():
    """Qwen3's 151,936 tokens (38 chunks, the last partial), batch 4 bf16, in the interpreter."""
    _assert_matches_torch(_inputs(4, 151936, torch.bfloat16, seed=3))


def test_ties_take_the_first_index():
    """Greedy ties: the first max id, as ``torch.argmax``, also across chunks."""
    logits = torch.zeros(2, 600, device=DEV)
    logits[:, [300, 40, 599]] = 5.0  # chunk 0 (40) before chunk 1 (300) at chunk=256
    temp = torch.zeros(2, device=DEV)
    tok, lp = vs.vocab_sample(logits, temp, temp, SEEDS[:2].to(DEV), SEEDS[:2].to(DEV) * 0,
                              chunk=256)
    assert tok.tolist() == [40, 40]
    torch.testing.assert_close(lp, _torch(logits, temp, temp, SEEDS[:2].to(DEV),
                                          SEEDS[:2].to(DEV) * 0)[1], rtol=0, atol=1e-6)


def test_workspace_reused_and_counters_reset():
    """Repeated calls reuse one workspace per (device, B, V, chunk), leave every counter at 0,
    and give the same bits; a strided (row-sliced) logits view is read in place."""
    args = _inputs(4, 1000, torch.float32)
    first = vs.vocab_sample(*args, chunk=256)
    ws = vs.workspace(args[0].device, 4, 1000, 256)
    n_ws = len(vs._WORKSPACES)
    second = vs.vocab_sample(*args, chunk=256)
    assert len(vs._WORKSPACES) == n_ws and vs.workspace(args[0].device, 4, 1000, 256) is ws
    assert int(ws[2].abs().sum()) == 0 and ws[2].shape == (4,)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    wide = torch.cat([args[0], args[0]], dim=1)[:, 1000:]  # row stride 2000
    strided = vs.vocab_sample(wide, *args[1:], chunk=256)
    assert all(torch.equal(a, b) for a, b in zip(first, strided))


def test_routing_and_refusal():
    """``routed_sample``: use_sort=False -> the kernel (column 0 without full_logprobs),
    use_sort=True -> the fallback; unsupported logits raise ``ValueError``."""
    logits, temp, min_p, seeds, gen = _inputs(4, 300, torch.float32)
    off_k, off_p = torch.zeros(4, dtype=torch.long, device=DEV), torch.ones(4, device=DEV)
    calls = []

    def fallback(*a, **k):
        calls.append(k["use_sort"])
        return sampler.sample(*a, **k)
    got = vs.routed_sample(logits, temp, min_p, off_k, off_p, seeds, gen, use_sort=False,
                           full_logprobs=True, fallback=fallback)
    assert not calls and all(torch.equal(a, b) for a, b in zip(
        got, vs.vocab_sample(logits, temp, min_p, seeds, gen)))
    tok, lp = vs.routed_sample(logits, temp, min_p, off_k, off_p, seeds, gen, use_sort=False,
                               fallback=fallback)
    assert torch.equal(tok, got[0]) and lp.shape == (4,) and torch.equal(lp, got[1][:, 0])
    vs.routed_sample(logits, temp, min_p, off_k + 5, off_p, seeds, gen, use_sort=True,
                     fallback=fallback)
    assert calls == [True]
    with pytest.raises(ValueError, match="unsupported logits"):
        vs.vocab_sample(logits.t(), temp, min_p, seeds, gen)


@pytest.mark.skipif(DEV != "cpu", reason="runs the USE_GDC branches in the interpreter; CUDA: "
                    "test_gpu_qwen3_vocab_matches_torch under the engine's PDL on the H200")
def test_gdc_branches_give_the_same_bits(gdc_stubs):  # noqa: F811 -- the fixture
    """``USE_GDC=True`` (PDL instructions stubbed): the plain launch's outputs bit for bit; one
    wait in every program of both kernels, one launch_dependents in every kernel-1 program."""
    args = _inputs(4, 1000, torch.float32)
    want = vs.vocab_sample(*args, chunk=256)
    with pdl.scope(True):
        got = vs.vocab_sample(*args, chunk=256)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert gdc_stubs == {"wait": 2 * 4 * 4, "launch": 4 * 4}


CHI_SETTINGS = [(1.0, 0.1), (0.7, 0.0), (1.3, 0.05)]  # (temperature, min_p): no top-k/top-p


@pytest.mark.parametrize("t,min_p", CHI_SETTINGS)
def test_empirical_distribution_chi_square(t, min_p):
    """``test_sampler.test_empirical_distribution_chi_square`` against the kernel, for the
    sampler settings it serves (its first one, plus two more): filtered tokens never drawn,
    Pearson p > 1e-3, logprob = log of the exact filtered probability. 20,000 rows on CUDA,
    400 in the interpreter (~20 ms a program): there it catches gross errors only (T 0.7 taken
    as 1.0 would add ~37 to an expected statistic of ~23); the exact-token parity above with
    the torch sampler, whose own chi-square draws 20,000 rows, carries the distribution."""
    vocab, n = 24, 20000 if DEV == "cuda" else 400
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(2)).to(DEV)
    logits = logits.expand(n, vocab)  # row stride 0: every row the same distribution
    temp, mp = torch.full((n,), t, device=DEV), torch.full((n,), min_p, device=DEV)
    toks, lps = vs.vocab_sample(logits, temp, mp, (torch.arange(n) * 7919 + 11).to(DEV),
                                torch.zeros(n, dtype=torch.long, device=DEV), chunk=32)
    exact = reference_probs(logits[0].double().cpu().numpy(), t, 1.0, -1, min_p)
    toks = toks.cpu().numpy()
    counts = np.bincount(toks, minlength=vocab)
    assert counts[exact == 0].sum() == 0
    assert chi_square_p(counts, exact) > 1e-3
    np.testing.assert_allclose(lps[:, 0].exp().cpu().numpy(), exact[toks], rtol=1e-4)


_AOT = """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nbhelpers.engine.kernels import pdl
from nbhelpers.engine.kernels import vocab_sample as vs
from nbhelpers.engine.kernels.vocab_sample import _uniform
PTRS = {"logits_ptr": "*bf16", "idx_ptr": "*i32", "cnt_ptr": "*i32", "seed_ptr": "*i64",
        "gen_ptr": "*i64", "tok_ptr": "*i64"}
FIRST_GLOBAL = re.compile(r"\\b(ld|st|atom|red)\\.global")
for kern, consts in ((vs._vocab_sample_softmax_stats, {"CHUNK": 4096}),
                     (vs._vocab_sample_argmax_race, {"CHUNK": 4096, "BLOCK_C": 64,
                                                     "ACCURATE_LOG": True})):
    for gdc in (True, False):
        c = {**consts, "USE_GDC": gdc}
        sig = {a: "constexpr" if a in c else PTRS.get(a, "*fp32" if a.endswith("_ptr")
                                                      else "i32") for a in kern.arg_names}
        src = ASTSource(kern, signature=sig,
                        constexprs={(kern.arg_names.index(k),): v for k, v in c.items()})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": 8}).asm["ptx"]
        wait = ptx.find("griddepcontrol.wait")
        if not gdc:
            assert "griddepcontrol" not in ptx
            continue
        assert wait >= 0 and ptx.count("griddepcontrol.wait") == 1
        assert not FIRST_GLOBAL.search(ptx[:wait]), FIRST_GLOBAL.findall(ptx[:wait])
print("compiled")
"""


def test_kernels_build_for_sm90_with_wait_first():
    """Both kernels build for sm_90 (bf16 logits); with ``USE_GDC`` one ``griddepcontrol.wait``
    and no global load, store or atomic before it (``pdl.py``'s rule), without it none."""
    assert_compiles_for_sm90(_AOT)


# ------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: runs on the H200 suite")
@pytest.mark.parametrize("B", [4, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_qwen3_vocab_matches_torch(B, dtype):
    """Qwen3-4B's vocabulary (151,936) at batch 4 and 32 on the GPU: tokens equal and
    logprobs within 1e-5 of the eager torch sampler over three seed sets, the counters at 0
    after, and a CUDA-graph replay of the launch pair giving the same outputs."""
    for seed in range(3):
        _assert_matches_torch(_inputs(B, 151936, dtype, seed, device="cuda"))
    args = _inputs(B, 151936, dtype, 7, device="cuda")
    want = vs.vocab_sample(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = vs.vocab_sample(*args)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert int(vs.workspace(args[0].device, B, 151936)[2].abs().sum()) == 0
