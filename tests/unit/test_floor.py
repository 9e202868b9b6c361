"""The bandwidth floor (nbhelpers.bench.floor), the flex sidecar's floor/breakdown keys, profiling
of every registered architecture, and figures held to their own run (issue 12 item 1; issue 11's
Gemma-4 ``count_decode_ops`` bullet). CPU, tiny sizes: the code path, not the numbers."""

from __future__ import annotations

import math

import pytest
import torch

from nbhelpers.bench import flex_sweep as eb
from nbhelpers.bench import floor as fl
from nbhelpers.config import LoraSpec

torch.set_num_threads(1)
TINY = eb.TINY_QWEN3_SHAPE  # hidden 64, 2 layers, 4 q / 2 kv heads of 16, inter 128, vocab 1024


@pytest.fixture(scope="module")
def tiny():
    return eb.random_qwen3(TINY, dtype="float32", device="cpu")


def test_read_bandwidth_is_positive_and_finite_on_a_small_buffer():
    bw = fl.read_bandwidth("cpu", nbytes=1 << 20, rounds=3)
    assert math.isfinite(bw["bytes_per_s"]) and bw["bytes_per_s"] > 0
    assert bw["buffer_bytes"] == 1 << 20 and bw["median_s"] > 0
    with pytest.raises(ValueError, match="use >= 2"):
        fl.read_bandwidth("cpu", nbytes=1 << 10, rounds=0)


def test_step_bytes_by_hand_on_the_tiny_config(tiny):
    lora = LoraSpec(rank=8, alpha=16)
    got = fl.step_bytes(tiny.config, batch=4, context_len=20.0, lora=lora,
                        weight_dtype="float32", adapter_dtype="float32")
    # per layer: q 64x64 + k 32x64 + v 32x64 + o 64x64 + gate/up/down 3 x 128x64 + 2 norms of 64
    per_layer = 4096 + 2048 + 2048 + 4096 + 3 * 8192 + 2 * 64
    assert got["weights"] == 4 * (2 * per_layer + 64 + 1024 * 64 + 4 * 64)
    # r (N + K) per target: q 64+64, k 32+64, v 32+64, o 64+64, gate/up/down 3 x (128+64)
    assert got["lora"] == 4 * 2 * 8 * (128 + 96 + 96 + 128 + 3 * 192)
    assert got["kv"] == 4 * 2 * 2 * 2 * 16 * 4 * 20.0  # bytes, K+V, layers, kv heads, d, rows, ctx
    assert got["total"] == got["weights"] + got["lora"] + got["kv"]


def test_step_bytes_agree_with_the_modules_parameters(tiny):
    """The formula's weights and LoRA bytes equal the real tensors (an independent count)."""
    peft = eb.attach_lora(eb.random_qwen3(TINY, dtype="float32", device="cpu"),
                          LoraSpec(rank=4, alpha=8), adapter_dtype="float32")
    lora, dtype = fl.lora_of(peft)
    assert lora.rank == 4 and dtype == "float32"
    got = fl.step_bytes(peft.config, 1, 1.0, lora, "float32", dtype)
    params = dict(peft.named_parameters())
    lora_bytes = sum(p.numel() * 4 for n, p in params.items() if "lora_" in n)
    base = sum(p.numel() * 4 for n, p in params.items() if "lora_" not in n
               and "embed_tokens" not in n and not n.endswith(("q_norm.weight", "k_norm.weight")))
    lm_head_and_one_row = 4 * TINY["vocab_size"] * 64 + 4 * 64  # tied: read as lm_head
    assert got["lora"] == lora_bytes
    assert got["weights"] == base + lm_head_and_one_row


def test_step_bytes_refuses_an_architecture_without_a_formula():
    from nbhelpers.model_configs import tiny_gemma4
    with pytest.raises(ValueError, match="gemma4"):
        fl.step_bytes(tiny_gemma4(), 1, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        fl.step_bytes(eb.random_qwen3(TINY, dtype="float32", device="cpu").config, 1, 1.0,
                      weight_dtype="int3")


def test_pct_of_floor_arithmetic():
    # issue 12's numbers: 8.05 GB a step at 4.28 TB/s in a 4.0 ms step: 47.0 %
    assert fl.pct_of_floor(8.05e9, 4.0e-3, 4.28e12) == pytest.approx(8.05e9 / 4e-3 / 4.28e12 * 100)
    assert fl.pct_of_floor(1.0, 1.0, 1.0) == 100.0
    for bad in ((0.0, 1.0, 1.0), (1.0, float("nan"), 1.0), (1.0, 1.0, -1.0)):
        with pytest.raises(ValueError, match="positive and finite"):
            fl.pct_of_floor(*bad)


def test_cold_gemm_times_cover_every_decode_shape_and_the_engine_kernels(tiny):
    if torch.cuda.is_available():
        pytest.skip("CPU path through Triton's interpreter (off on a CUDA host); the GPU test "
                    "below times the same kernels on the device")
    rows = fl.cold_gemm_times(tiny.config, 4, "cpu", "bfloat16", LoraSpec(rank=16, alpha=32),
                              "float32", cycle_bytes=1, rounds=1)
    assert set(rows) == {"qkv", "o", "gate_up", "down", "lm_head"}
    assert (rows["qkv"]["n"], rows["qkv"]["k"], rows["qkv"]["per_step"]) == (128, 64, 2)
    assert rows["lm_head"]["n"] == TINY["vocab_size"] and rows["lm_head"]["per_step"] == 1
    for name, r in rows.items():
        assert r["cublas_ms"] > 0 and r["cublas_bytes_per_s"] > 0, name
    for name in ("qkv", "o", "gate_up", "down"):  # Triton interpreter on the CPU
        assert rows[name]["lora_shrink_ms"] > 0 and rows[name]["lora_expand_ms"] > 0, rows[name]
        assert rows[name]["lora_gemm_ms"] is None or rows[name]["lora_gemm_ms"] > 0
    assert "no LoRA on lm_head" in rows["lm_head"]["notes"]
    base = fl.cold_gemm_times(tiny.config, 4, "cpu", "bfloat16", None, cycle_bytes=1, rounds=1)
    for name in ("qkv", "o", "gate_up", "down"):  # the engine's own base GEMM, if it exists
        assert base[name].get("engine_gemm_ms") or base[name].get("note_lora_gemm"), base[name]


@pytest.fixture(scope="module")
def point(tiny):
    peft = eb.attach_lora(tiny, LoraSpec(rank=4, alpha=8))
    res = eb.run_flex_point(peft, 2, 6, 4, rounds=1, warmup=0, sync_every=2, profile=True)
    side = eb.flex_sidecar("t_b2_lora", {"name": "tiny"}, LoraSpec(rank=4, alpha=8), 2, 6, 4,
                           res, run_id="run-a")
    return res, side


def test_tiny_cpu_point_sidecar_records_floor_and_pct(point):
    _, side = point
    assert side["run_id"] == "run-a"
    floor = side["floor"]
    assert floor["error"] is None and floor["bandwidth_bytes_per_s"] > 0
    assert set(floor["bytes_per_step"]) == {"weights", "lora", "kv", "total"}
    assert floor["bytes_per_step"]["lora"] > 0 and floor["context_len"] == 6 + 4 / 2
    assert floor["floor_ms_per_step"] == pytest.approx(
        floor["bytes_per_step"]["total"] / floor["bandwidth_bytes_per_s"] * 1e3)
    assert side["pct_of_floor"] == pytest.approx(fl.pct_of_floor(
        floor["bytes_per_step"]["total"], side["breakdown"]["decode_step_ms"] / 1e3,
        floor["bandwidth_bytes_per_s"]))
    ops = side["breakdown"]["aten_ops"]
    assert ops["ops_per_step"] > 0 and ops["ops_per_layer"] > 0 and ops["note"] is None
    assert "profile" not in side["breakdown"]  # CUDA kernel profile: GPU only
    # the GEMM tuners' tables: on the CPU nothing is tuned (skinny_gemm "auto" -> off there;
    # tests/engine/test_skinny_gemm_cublas.py checks a filled table in a sidecar)
    assert side["breakdown"]["skinny_tuner"] == {} == side["breakdown"]["lora_gemm_tuner"]


@pytest.mark.parametrize("arch", ["tiny_qwen3", "tiny_llama", "tiny_gemma4"])
def test_profile_runs_on_every_registered_architecture(arch):
    """Issue 11: ``run_flex_point(profile=True)`` raised inside ``count_decode_ops`` on Gemma-4
    (it drops the last layer; per-layer inputs cannot). Now every architecture profiles; where
    a layer cannot be dropped, ``ops_per_layer`` is None with a note."""
    import transformers

    from nbhelpers import model_configs
    cfg = getattr(model_configs, arch)()
    torch.manual_seed(0)
    model = getattr(transformers, cfg.architectures[0])(cfg).eval()
    res = eb.run_flex_point(model, 2, 5, 3, rounds=1, warmup=0, sync_every=2, profile=True)
    ops = res["breakdown"]["aten_ops"]
    assert ops["ops_per_step"] > 0
    if arch == "tiny_gemma4":
        assert ops["ops_per_layer"] is None and "cannot step without" in ops["note"]
        assert res["floor"]["error"] and res["pct_of_floor"] is None  # no byte formula yet
    else:
        assert ops["ops_per_layer"] > 0 and ops["note"] is None and res["pct_of_floor"] > 0


def test_figures_hold_to_their_own_run(point):
    _, side = point
    other = {**side, "run_id": "run-b"}
    frame = eb.flex_frame([side], run_id="run-a")
    assert frame.loc[0, "pct_of_floor"] == pytest.approx(side["pct_of_floor"])
    assert eb.pct_figure(frame, "run-a") is not None
    assert eb.sweep_figure(frame, "run-a") is not None
    with pytest.raises(ValueError, match="other runs"):
        eb.flex_frame([side, other], run_id="run-a")
    with pytest.raises(ValueError, match="rows of runs"):
        eb.sweep_figure(eb.flex_frame([side, other]), "run-a")
    with pytest.raises(ValueError, match="rows of runs"):
        eb.pct_figure(eb.flex_frame([other]), "run-a")
    with pytest.raises(ValueError, match="other runs"):
        eb.breakdown_figure(other, "run-a")
    with pytest.raises(ValueError, match="no kernel profile"):
        eb.breakdown_figure(side, "run-a")
    earlier = eb.earlier_frame([side, other], "run-a")
    assert list(earlier["run_id"]) == ["run-b"] and "source" in earlier


def test_sweep_figure_wants_labelled_reference_rows(point):
    import pandas as pd
    _, side = point
    frame = eb.flex_frame([side], run_id="run-a")
    ref = pd.DataFrame([{"engine": "vllm", "lora": True, "batch": 2, "decode_tok_per_s": 5.0,
                         "error": ""}])
    with pytest.raises(ValueError, match="source"):
        eb.sweep_figure(frame, "run-a", ref)
    assert eb.sweep_figure(frame, "run-a", ref.assign(source="gold_x_2026-11-30.json"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (H200 floor)")
def test_gpu_floor_of_the_qwen3_4b_shape_is_physical():
    """On the GPU: read bandwidth between 1 and 6 TB/s (H200 spec 4.8 TB/s), and no cold-weight
    GEMM reads its weights faster than 1.15x that bandwidth (faster would mean L2 held them,
    i.e. the cycling failed)."""
    from transformers import Qwen3Config
    cfg = Qwen3Config(**eb.QWEN3_4B_SHAPE)
    bw = fl.read_bandwidth("cuda")["bytes_per_s"]
    assert 1e12 < bw < 6e12, bw
    rows = fl.cold_gemm_times(cfg, 4, "cuda", "bfloat16", LoraSpec(rank=32, alpha=64), "float32")
    for name, r in rows.items():
        assert 0 < r["cublas_bytes_per_s"] < 1.15 * bw, (name, r)
        assert name == "lm_head" or r["lora_shrink_ms"] > 0, (name, r)
    assert fl.step_bytes(cfg, 32, 406)["weights"] == pytest.approx(8.05e9, rel=0.01)
