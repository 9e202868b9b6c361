"""Runner option ``skinny_gemm_cublas`` (``engine/skinny_linear.py``), the small-N large-K
candidates (``engine/kernels/skinny_gemm.py`` ``SMALL_N_CONFIGS``) and the tuner table the bench
sidecars carry (``engine/tuner_tables.py``): option checks, the choice with a fake timer where
cuBLAS wins ("auto" keeps it, "never" takes the best Triton config), separate cache keys, stale
entries re-timed, the new configs against an fp64 reference in the interpreter, and the table in a
schema-v1 sidecar.

The tuner tests run on any host (a fake timer and an ``F.linear`` stand-in for the kernel); the
kernel tests run under ``TRITON_INTERPRET=1`` on the CPU (``tests/conftest.py``).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="skinny_gemm needs the triton package")

from _kernels import DEV, skip_unless_runnable
from _tiny import tiny_model

from nbhelpers.engine import LLM
from nbhelpers.engine.kernels import skinny_gemm as sg
from nbhelpers.engine.kernels import skinny_gemm_tune as tune
from nbhelpers.engine.runner_options import RunnerOptions
from nbhelpers.engine.skinny_linear import SkinnyLinear
from nbhelpers.engine.tuner_tables import tuner_tables

skip_unless_runnable(sg)
BF16 = torch.bfloat16
H200_SMEM = 232448
"""``shared_memory_per_block_optin`` of the H200 (bytes)."""


@pytest.fixture(autouse=True)
def _own_tuning_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NBHELPERS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tune, "_TUNER", None)


def test_option_values_and_errors():
    assert RunnerOptions().skinny_gemm_cublas == "auto"
    assert RunnerOptions(skinny_gemm_cublas="never").skinny_gemm_cublas == "never"
    for bad in ("off", "Never", None, 0):
        with pytest.raises(ValueError, match=r"skinny_gemm_cublas=.*\('auto', 'never'\)"):
            RunnerOptions(skinny_gemm_cublas=bad)
    with pytest.raises(ValueError, match=r"SkinnyLinear.cublas='no'.*\('auto', 'never'\)"):
        SkinnyLinear("triton", cublas="no")
    from nbhelpers.bench import flex_ab
    with pytest.raises(ValueError, match=r"--variants part 0: .*skinny_gemm_cublas"):
        flex_ab.check_engine_options({"skinny_gemm_cublas": "sometimes"}, "--variants part 0")
    assert flex_ab.check_engine_options({"skinny_gemm_cublas": "never"}, "x") == {
        "skinny_gemm_cublas": "never"}
    with pytest.raises(ValueError, match="skinny_gemm_cublas"):
        LLM(tiny_model("qwen3").to(DEV), page_size=64, num_pages=4, max_model_len=32,
            skinny_gemm_cublas="always")


def test_engine_passes_the_option_to_its_skinny_linear():
    llm = LLM(tiny_model("qwen3").to(DEV), page_size=64, num_pages=4, max_model_len=32,
              skinny_gemm="triton", skinny_gemm_cublas="never")
    assert llm.runner.skinny.cublas == "never"


def test_cache_keys_keep_the_two_modes_apart():
    x, w = torch.randn(4, 64), torch.randn(40, 64)
    auto, never = SkinnyLinear("triton").key(x, w, None), SkinnyLinear(
        "triton", cublas="never").key(x, w, None)
    assert auto == tune.shape_key("cpu", 4, 40, 64, torch.float32, False)  # unchanged key
    assert never == auto + "|nocublas" and never != auto


MS = {"cublas": 1.0, "n64_k128_s4_w4_st3": 3.0, "n32_k128_s8_w4_st3": 2.0}
"""Fake times (ms per timed call): cuBLAS wins, ``n32_k128_s8`` is the best Triton config."""


def _fake(ms=MS):
    """``(configs, launch, timer)``: configs named as in ``ms``; ``launch`` is ``F.linear``
    (correct output) recording its config; ``timer`` runs the candidate and returns the fake
    time of what it launched (no launch: the cuBLAS candidate)."""
    cfgs = {"n64_k128_s4_w4_st3": sg.Config(64, 128, 4), "n32_k128_s8_w4_st3": sg.Config(32, 128, 8)}
    seen: list = []

    def launch(x, w, bias, cfg):
        seen.append(cfg)
        return F.linear(x, w, bias)

    def timer(fn):
        seen.clear()
        fn()
        return ms[tune.config_name(seen[-1])] if seen else ms["cublas"]
    return cfgs, launch, timer


def _operands():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 64, generator=g), torch.randn(40, 64, generator=g)


def test_auto_keeps_cublas_never_takes_the_best_triton_config(tmp_path):
    cfgs, launch, timer = _fake()
    x, w = _operands()
    t = tune.SkinnyTuner(tmp_path / "c.json", timer)
    key = tune.shape_key("cpu", 4, 40, 64, torch.float32, False)
    key_never = tune.shape_key("cpu", 4, 40, 64, torch.float32, False, cublas=False)
    assert t.choose_gemm(key, x, w, None, cfgs, launch) == "cublas"
    assert t.choose_gemm(key_never, x, w, None, cfgs, launch, cublas=False) == "n32_k128_s8_w4_st3"
    table = json.loads((tmp_path / "c.json").read_text())
    assert set(table[key]["ms"]) == {"cublas", *cfgs}
    assert set(table[key_never]["ms"]) == set(cfgs)  # cuBLAS not even timed
    copies = min(tune.MAX_COPIES, -(-tune.ROTATE_BYTES // (w.numel() * 4)))  # 64 here
    assert table[key]["ms"]["n32_k128_s8_w4_st3"] == pytest.approx(2.0 / copies)  # per GEMM

    def never(fn):
        raise AssertionError("a cached key was timed again")
    again = tune.SkinnyTuner(tmp_path / "c.json", never)  # both served from the file
    assert again.choose_gemm(key, x, w, None, cfgs, launch) == "cublas"
    assert again.choose_gemm(key_never, x, w, None, cfgs, launch, cublas=False) != "cublas"


def test_stale_entry_is_retimed_when_candidates_grow(tmp_path):
    cfgs, launch, timer = _fake()
    x, w = _operands()
    key = "dev|skinny|M4|N40|K64|float32|bias0"
    (tmp_path / "c.json").write_text(json.dumps({key: {"choice": "cublas",
                                                       "ms": {"cublas": 1.0,
                                                              "n64_k128_s4_w4_st3": 3.0}}}))
    t = tune.SkinnyTuner(tmp_path / "c.json", timer)
    assert t.choose_gemm(key, x, w, None, cfgs, launch) == "cublas"
    assert set(t.table[key]["ms"]) == {"cublas", *cfgs}  # the new candidate was timed


@pytest.mark.filterwarnings("ignore:skinny_gemm tuner.*failed for k2")  # the broken launches
def test_wrong_and_failing_configs_are_recorded_inf_and_never_chosen(tmp_path):
    cfgs, launch, timer = _fake({**MS, "cublas": 9.0})
    x, w = _operands()

    def bad_launch(x, w, bias, cfg):
        out = launch(x, w, bias, cfg)
        if cfg.block_n == 32:
            return out + 1.0  # a wrong result: dropped before timing
        return out
    t = tune.SkinnyTuner(tmp_path / "c.json", timer)
    assert t.choose_gemm("k", x, w, None, cfgs, bad_launch, cublas=False) == "n64_k128_s4_w4_st3"
    assert t.table["k"]["ms"]["n32_k128_s8_w4_st3"] == math.inf
    assert "n32_k128_s8_w4_st3" in json.loads((tmp_path / "c.json").read_text())["k"]["ms"]

    def broken(x, w, bias, cfg):
        raise RuntimeError("out of resources")
    with pytest.warns(UserWarning, match="keeps F.linear"):
        assert t.choose_gemm("k2", x, w, None, cfgs, broken, cublas=False) == "cublas"


def test_skinny_linear_never_records_a_triton_config_and_the_table(monkeypatch, tmp_path):
    """``SkinnyLinear.tune_shape`` (what ``config`` runs at a shape's first eager CUDA call) with
    the fake timer: "auto" records ``None`` (cuBLAS), "never" the best Triton config; the
    runner's tuner table lists each shape with its times."""
    times = {name: 5.0 for name in tune.candidates(4, 40, 64, 4, H200_SMEM)}
    times.update({"cublas": 1.0, "n32_k128_s8_w4_st4": 2.0})
    _, launch, timer = _fake(times)
    monkeypatch.setattr(sg, "skinny_gemm", launch)
    monkeypatch.setattr(tune, "_TUNER", tune.SkinnyTuner(tmp_path / "c.json", timer))
    x, w = _operands()
    auto, never = SkinnyLinear("triton"), SkinnyLinear("triton", cublas="never")
    assert auto.tune_shape(x, w, None, H200_SMEM) is None
    assert never.tune_shape(x, w, None, H200_SMEM) == sg.Config(32, 128, 8, 4, 4)

    class Runner:  # the two attributes tuner_tables reads
        skinny = never
        model = type("M", (), {"live_groups": staticmethod(list)})()
    tables = tuner_tables(Runner())
    (key, entry), = tables["skinny_tuner"].items()
    assert key.endswith("|nocublas") and entry["choice"] == "n32_k128_s8_w4_st4"
    assert "cublas" not in entry["ms"] and entry["ms"]["n32_k128_s8_w4_st4"] == pytest.approx(
        2.0 / min(tune.MAX_COPIES, -(-tune.ROTATE_BYTES // (w.numel() * 4))))
    assert tables["lora_gemm_tuner"] == {}
    Runner.skinny = auto
    assert next(iter(tuner_tables(Runner())["skinny_tuner"].values()))["choice"] == "cublas"
    _sidecar_carries(tables)


def test_lora_gemm_table_merges_the_groups_choices(tmp_path, monkeypatch):
    """``lora_fused`` choices of several groups (one key shared by two layers' groups) with the
    ``lora_gemm_tune`` times; a group with the path off adds nothing."""
    from nbhelpers.engine.kernels import lora_gemm, lora_gemm_tune
    from nbhelpers.engine.lora_fused import LoraFusedGemm
    ms = {"cublas": 2.0, "n64_k128_s1_w4_st3": 1.0}
    t = lora_gemm_tune.Tuner(tmp_path / "l.json", timer=lambda fn: ms[fn()])
    monkeypatch.setattr(lora_gemm_tune, "_TUNER", t)
    assert t.choose("qkv", {n: (lambda n=n: n) for n in ms}) == "n64_k128_s1_w4_st3"
    groups = []
    for choices in ({"qkv": lora_gemm.Config(64, 128, 1)}, {"qkv": lora_gemm.Config(64, 128, 1),
                                                            "o": None}, {}):
        fused = LoraFusedGemm()
        fused.set_mode("triton" if choices else "off")
        fused.choices = choices
        groups.append(type("G", (), {"_lora_gemm": fused})())
    runner = type("R", (), {"skinny": None,
                            "model": type("M", (), {"live_groups": lambda self: groups})()})()
    assert tuner_tables(runner) == {
        "skinny_tuner": {},
        "lora_gemm_tuner": {"o": {"choice": "cublas", "ms": {}},  # chosen untimed: no times
                            "qkv": {"choice": "n64_k128_s1_w4_st3", "ms": ms}}}


def _sidecar_carries(tables):
    """A flex bench sidecar (``flex_sweep.flex_sidecar``) with ``tables`` in its breakdown is
    schema-v1 and JSON-clean (an ``inf`` time becomes ``None``)."""
    from nbhelpers.bench import flex_sweep
    from nbhelpers.stats import validate_sidecar
    key = next(iter(tables["skinny_tuner"]))
    tables["skinny_tuner"][key]["ms"]["n128_k256_s1_w8_st3"] = math.inf  # a failed candidate
    res = {"rounds": [{"wall_s": 1.0, "new_tokens": 8, "prompt_tokens": 12}],
           "breakdown": {"decode_step_ms": 1.0, **tables}}
    side = flex_sweep.flex_sidecar("t", {"name": "tiny"}, None, 2, 6, 4, res, run_id="r")
    validate_sidecar(side)
    got = json.loads(json.dumps(side, allow_nan=False))["breakdown"]["skinny_tuner"][key]
    assert got["choice"] == "n32_k128_s8_w4_st4" and got["ms"]["n128_k256_s1_w8_st3"] is None


# ------------------------------------------------------------ the small-N large-K candidates


def test_small_n_configs_only_where_they_keep_programs_and_k_tiles():
    o, down = sg.small_n_configs(2592, 4096), sg.small_n_configs(2592, 9728)
    assert len(o) == 4 and len(down) == len(sg.SMALL_N_CONFIGS) == 8
    assert sg.small_n_configs(6144, 2560) == () == sg.small_n_configs(2592, 2560)
    assert sg.small_n_configs(19456, 9728) == ()  # large N: not offered
    for n, k, cfgs in ((2592, 4096, o), (2592, 9728, down), (2560, 4096, o)):
        for cfg in cfgs:
            split, k_per = sg.launch_split(k, cfg)
            assert -(-n // cfg.block_n) * split >= 2 * sg.NUM_SMS and k_per // cfg.block_k >= 4
    names = tune.candidates(4, 2592, 4096, 2, H200_SMEM)
    assert {tune.config_name(c) for c in o} <= set(names)
    assert len(tune.candidates(32, 2592, 9728, 2, H200_SMEM)) == len(
        tune.candidates(32, 6144, 2560, 2, H200_SMEM)) + 8


def test_small_n_configs_fit_and_split_without_empty_chunks():
    for cfg in sg.SMALL_N_CONFIGS:
        for elem, bm in ((2, 16), (2, 32), (4, 32)):
            assert sg.fits(cfg, elem, H200_SMEM, bm), (cfg, elem, bm)
        for k in (1, 127, 4096, 4128, 9728):
            split, k_per = sg.launch_split(k, cfg)
            assert k_per % cfg.block_k == 0 and 1 <= split <= cfg.split
            assert (split - 1) * k_per < k <= split * k_per


@pytest.mark.parametrize("cfg", sg.SMALL_N_CONFIGS, ids=tune.config_name)
@pytest.mark.parametrize("m,dtype", [(4, BF16), (4, torch.float32), (20, BF16)],
                         ids=["m4_bf16", "m4_fp32", "m20_bf16"])
def test_small_n_config_matches_reference(cfg, m, dtype):
    """N 100 (three full 32-wide tiles and a ragged one), K with a ragged last tile and
    exactly ``cfg.split`` splits of 2 K tiles; twice (the ticket counters reset)."""
    k = 2 * cfg.split * cfg.block_k - 37
    assert sg.launch_split(k, cfg)[0] == cfg.split
    g = torch.Generator().manual_seed(cfg.split + m)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    w = (torch.randn(100, k, generator=g) * 0.1).to(dtype).to(DEV)
    ref = x.double() @ w.double().t()
    y = sg.skinny_gemm(x, w, None, cfg)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2 ** -7,
                                                                        "atol": 1e-3}
    torch.testing.assert_close(y.double(), ref, **tol)
    assert torch.equal(y, sg.skinny_gemm(x, w, None, cfg))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="tuning times on a CUDA GPU (on the "
                    "CPU the default config runs untimed); run on a GPU host")
@pytest.mark.parametrize("m", [4, 32])
def test_gpu_never_tunes_o_proj_to_a_triton_config(m):
    """Qwen3-4B's o_proj with LoRA r32 ``ext`` rows: "never" runs a Triton config (timed with
    the small-N candidates, no cuBLAS time), "auto" times cuBLAS too; both correct."""
    x = torch.randn(m, 4096, device="cuda", dtype=BF16)
    w = torch.randn(2592, 4096, device="cuda", dtype=BF16) * 0.02
    ref = x.double() @ w.double().t()
    for cublas in ("never", "auto"):
        route = SkinnyLinear("triton", cublas=cublas)
        with route.decoding():
            y = route(x, w)
        torch.testing.assert_close(y.double(), ref, rtol=2 ** -7, atol=1e-3)
        entry = tune.tuner().table[route.key(x, w, None)]
        assert (tune.CUBLAS in entry["ms"]) == (cublas == "auto")
        assert {tune.config_name(c) for c in sg.small_n_configs(2592, 4096)} <= set(entry["ms"])
        if cublas == "never":
            assert route.choices[route.key(x, w, None)] is not None
