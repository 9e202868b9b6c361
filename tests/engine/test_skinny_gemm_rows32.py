"""The 32- and 64-row tiles of the skinny decode GEMM (``engine/kernels/skinny_gemm.py``,
``BLOCK_M = 32`` for 17-32 rows, 64 for 33-64) and their routing (runner option ``skinny_gemm_max_rows``,
``engine/skinny_linear.py``): kernel vs an fp64 reference, the per-BLOCK_M workspace and
shared-memory pruning, the sm_90 build, the row limit, option checks, and batches of 20 requests
(decode bucket 32) and 40 (bucket 64, ``skinny_gemm_max_rows=64``) matching ``skinny_gemm="off"``. The 16-row path: ``test_skinny_gemm.py``,
``test_skinny_gemm_engine.py``.

On the CPU the kernel runs under ``TRITON_INTERPRET=1`` (``tests/conftest.py``); skipped when
triton is not importable.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="skinny_gemm needs the triton package")

from _kernels import DEV, assert_compiles_for_sm90, skip_unless_runnable
from _tiny import random_prompts, tiny_model
from test_skinny_gemm import _AOT, _assert_matches, _operands
from test_skinny_gemm_engine import _count, _force_kernel
from test_skinny_gemm_engine import _generate as engine_generate

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM
from nbhelpers.engine.kernels import skinny_gemm as sg
from nbhelpers.engine.kernels import skinny_gemm_tune as tune
from nbhelpers.engine.runner_options import RunnerOptions
from nbhelpers.engine.skinny_linear import SkinnyLinear

skip_unless_runnable(sg)
BF16 = torch.bfloat16
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)


@pytest.fixture(autouse=True)
def _own_tuning_cache(tmp_path, monkeypatch):
    """GPU runs tune the tiny shapes: into a cache of this test's own, not the user's."""
    monkeypatch.setenv("NBHELPERS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tune, "_TUNER", None)


@pytest.mark.parametrize("m", [17, 24, 32, 33, 64])
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("split", [1, 3])
def test_kernel_32_row_tile_matches_reference_twice(m, dtype, bias, split):
    """N, K not multiples of the tiles; the same bits twice; the counters back at 0."""
    n, k = 100, 300
    x, w, b, ref = _operands(m, n, k, dtype, bias, seed=m)
    cfg = sg.Config(64, 128, split)
    bm = 32 if m <= 32 else 64
    assert sg.launch_split(k, cfg)[0] == split and sg.block_m(m) == bm
    y1 = sg.skinny_gemm(x, w, b, cfg)
    y2 = sg.skinny_gemm(x, w, b, cfg)
    _assert_matches(y1, ref, dtype)
    assert torch.equal(y1, y2)
    if split > 1:
        assert not sg.workspace(x.device, n, split, bm)[1].any()


def test_16_and_32_row_tiles_keep_their_own_workspaces():
    """4 rows then 24 rows of one (N, split): a 16-row workspace would be too small for the
    32-row tile's partials, so each BLOCK_M gets its own; both results correct."""
    n, split = 80, 4
    for m in (4, 24, 4):
        x, w, _, ref = _operands(m, n, 512, torch.float32, False, seed=m)
        _assert_matches(sg.skinny_gemm(x, w, None, sg.Config(32, 128, split)), ref,
                        torch.float32)
    ws16, ws32 = sg.workspace(DEV, n, split), sg.workspace(DEV, n, split, 32)
    assert ws16[0].numel() == split * 16 * n and ws32[0].numel() == split * 32 * n


def test_block_m_and_row_limit():
    assert [sg.block_m(m) for m in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    with pytest.raises(ValueError, match="65 rows > MAX_ROWS=64"):
        sg.block_m(65)
    x, w, _, _ = _operands(64, 32, 64, torch.float32, False)
    assert sg.supported(x, w)
    x, w, _, _ = _operands(65, 32, 64, torch.float32, False)
    assert not sg.supported(x, w)
    with pytest.raises(ValueError, match="use F.linear"):
        sg.skinny_gemm(x, w)


def test_shared_memory_and_pruning_use_the_row_tile():
    """fp32 n128/k128 with 4 stages: 221,184 B at BLOCK_M 16 fits the H200's 232,448 B,
    245,760 B at BLOCK_M 32 does not; the tuner's candidates follow the row count."""
    cfg = sg.Config(128, 128, 2, 4, 4)
    assert sg.shared_memory_bytes(cfg, 4) == sg.shared_memory_bytes(cfg, 4, 16) == 221184
    assert sg.shared_memory_bytes(cfg, 4, 32) == 245760
    assert sg.fits(cfg, 4, 232448) and not sg.fits(cfg, 4, 232448, block_m=32)
    name = tune.config_name(cfg)
    assert name in tune.candidates(16, 2560, 4096, 4, 232448)
    assert name not in tune.candidates(24, 2560, 4096, 4, 232448)
    assert name in tune.candidates(24, 2560, 4096, 2, 232448)  # bf16 still fits
    assert tune.m_bucket(17) == tune.m_bucket(32) == 32 != tune.m_bucket(16)
    assert tune.m_bucket(33) == tune.m_bucket(64) == 64
    # the 64-row tile: num_stages buffers (Triton 3.6's 294,912 B for n128/k256/3 stages in
    # bf16 on the H100, 2026-12-07, where num_stages - 1 gave 196,608)
    assert sg.shared_memory_bytes(cfg, 4, 64) == 393216  # 4 x (64 + 128) x 128 x 4 B
    assert name not in tune.candidates(40, 2560, 4096, 4, 232448)
    assert sg.shared_memory_bytes(cfg, 2, 64) == 196608
    assert name in tune.candidates(40, 2560, 4096, 2, 232448)  # bf16 at 64 rows fits
    big = sg.Config(128, 256, 1, 8, 3)
    assert sg.shared_memory_bytes(big, 2, 64) == 294912
    assert tune.config_name(big) not in tune.candidates(64, 6144, 2560, 2, 232448)


@pytest.mark.parametrize("bm", [32, 64])
@pytest.mark.parametrize("gdc", [False, True], ids=["plain", "pdl"])
def test_kernel_compiles_for_sm90_with_32_and_64_row_tiles(gdc, bm):
    """The 32- and 64-row tiles build to sm_90 cubins (bf16 and fp32 ``tl.dot``, the ticket
    atomics), the AOT script of ``test_skinny_gemm.py`` with ``BLOCK_M`` 32 / 64, with and
    without the PDL branch (``USE_GDC``)."""
    src = _AOT.replace('"BLOCK_M": 16', f'"BLOCK_M": {bm}').replace('"USE_GDC": False',
                                                                     f'"USE_GDC": {gdc}')
    assert f'"BLOCK_M": {bm}' in src and f'"USE_GDC": {gdc}' in src
    assert_compiles_for_sm90(src)


# ------------------------------------------------------------------ engine routing


def test_route_serves_up_to_max_rows(monkeypatch):
    """``max_rows=32`` (the default): 24 rows run the kernel, 33 keep F.linear; ``max_rows=16``:
    24 rows keep F.linear; ``max_rows=64``: 33 rows run the kernel, 65 keep F.linear."""
    _force_kernel(monkeypatch)
    calls = _count(monkeypatch)
    w = torch.randn(40, 64, device=DEV)
    x24, x33 = torch.randn(24, 64, device=DEV), torch.randn(33, 64, device=DEV)
    x65 = torch.randn(65, 64, device=DEV)
    wide, narrow = SkinnyLinear("triton"), SkinnyLinear("triton", max_rows=16)
    widest = SkinnyLinear("triton", max_rows=64)
    assert wide.max_rows == 32
    with wide.decoding(), narrow.decoding(), widest.decoding():
        torch.testing.assert_close(wide(x24, w), x24 @ w.t(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(wide(x33, w), x33 @ w.t())
        torch.testing.assert_close(narrow(x24, w), x24 @ w.t())
        torch.testing.assert_close(widest(x33, w), x33 @ w.t(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(widest(x65, w), x65 @ w.t())
    assert calls == [(24, 40), (33, 40)]


def test_max_rows_option_values():
    assert RunnerOptions().skinny_gemm_max_rows == 32
    assert RunnerOptions(skinny_gemm_max_rows=16).skinny_gemm_max_rows == 16
    assert RunnerOptions(skinny_gemm_max_rows=64).skinny_gemm_max_rows == 64
    for bad in (24, 48, 128, "32", 32.0, True):
        with pytest.raises(ValueError, match=r"RunnerOptions.skinny_gemm_max_rows=.*must be "
                           r"one of \(16, 32, 64\)"):
            RunnerOptions(skinny_gemm_max_rows=bad)
    with pytest.raises(ValueError,
                       match=r"SkinnyLinear.max_rows=8: must be one of \(16, 32, 64\)"):
        SkinnyLinear("triton", max_rows=8)
    with pytest.raises(ValueError, match="skinny_gemm_max_rows"):
        LLM(tiny_model("qwen3").to(DEV), page_size=64, num_pages=4, max_model_len=32,
            skinny_gemm_max_rows=48)


def _generate(model, prompts, **options):
    """One decode batch of up to 64 requests (one 64-token page each)."""
    return engine_generate(model, prompts, num_pages=48, sampling=GREEDY, max_num_seqs=64,
                           **options)


@pytest.mark.parametrize("n_requests,max_rows,tile,narrower,seed", [
    (20, 32, 32, 16, 6),  # bucket 32: the default routes it; max_rows=16 keeps F.linear
    (40, 64, 64, 32, 7),  # bucket 64: max_rows=64 routes it; the default (32) keeps F.linear
], ids=["batch20_tile32", "batch40_tile64"])
def test_engine_batch_matches_off(monkeypatch, n_requests, max_rows, tile, narrower, seed):
    """Tiny Qwen3, ``n_requests`` decoding together: with ``skinny_gemm_max_rows=max_rows`` the
    tokens of ``skinny_gemm="off"`` and its logprobs (|dlogprob| < 1e-4, fp32, the bound of
    ``test_skinny_gemm_engine.py``), every decode GEMM through the ``tile``-row tile; with
    ``skinny_gemm_max_rows=narrower`` no kernel launch at that batch (F.linear, same bits)."""
    model = tiny_model("qwen3").to(DEV)
    prompts = random_prompts(n_requests, 5, 12, seed=seed)
    calls = _count(monkeypatch)
    want = _generate(model, prompts, skinny_gemm="off")
    got = _generate(model, prompts, skinny_gemm="triton", skinny_gemm_max_rows=max_rows)
    for (gt, glp), (wt, wlp) in zip(got, want, strict=True):
        assert gt == wt
        assert max(abs(a - b) for a, b in zip(glp, wlp, strict=True)) < 1e-4
    if DEV == "cpu":  # eager steps: one launch per GEMM (4 groups x 2 layers + lm_head)
        assert len(calls) == 9 * (GREEDY.max_new_tokens - 1)
        assert {m for m, _ in calls} == {tile}  # the bucket's rows, the rest padding
    calls.clear()
    narrow = _generate(model, prompts, skinny_gemm="triton", skinny_gemm_max_rows=narrower)
    assert narrow == want
    assert not calls
