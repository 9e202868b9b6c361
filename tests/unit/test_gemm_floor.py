"""Decode GEMMs against the floor (``nbhelpers/bench/gemm_floor.py``): the arithmetic on a
made-up sidecar, the archived H200 run's numbers, and the refusals."""

import json
from pathlib import Path

import pytest

from nbhelpers.bench import gemm_floor as gf

REPO = Path(__file__).resolve().parents[2]
H200_RUN = REPO / "executed/phase3_flex/33_flex_vs_baselines/20261207T131901Z_h200_2052410.json"


def _side(run_id, tuner, bw=4e12):
    return {"run_id": run_id, "floor": {"bandwidth_bytes_per_s": bw},
            "breakdown": {"skinny_tuner": tuner}}


def test_rows_split_each_shape_into_bytes_at_the_floor_and_the_rest():
    tuner = {"GPU|triton 3.6.0|skinny|M4|N1000|K2000|bfloat16|bias0":
             {"choice": "n64", "ms": {"n64": 0.002, "cublas": 0.003}},
             "GPU|triton 3.6.0|skinny|M4|N50|K2000|bfloat16|bias0":  # the LM head: N = vocab
             {"choice": "cublas", "ms": {"cublas": 0.001}},
             "GPU|triton 3.6.0|lora_gemm|M4|N8|K8|bfloat16": {"choice": "x", "ms": {"x": 1.0}}}
    sides = [_side("r1", tuner), _side("r1", tuner)]  # a second point repeats the shapes
    frame = gf.gemm_floor_frame(sides, "r1", num_layers=10, vocab_size=50)
    assert list(frame["N"]) == [50, 1000]  # one row per shape, other tuners left out
    layer = frame.set_index("N").loc[1000]
    assert layer["launches_per_step"] == 10 and layer["weight_mb"] == pytest.approx(4.0)
    assert layer["us"] == pytest.approx(2.0) and layer["floor_us"] == pytest.approx(1.0)
    assert layer["fixed_us"] == pytest.approx(1.0) and layer["tb_s"] == pytest.approx(2.0)
    assert layer["cublas_us"] == pytest.approx(3.0)
    head = frame.set_index("N").loc[50]
    assert head["launches_per_step"] == 1 and head["choice"] == "cublas"
    over = gf.step_overhead(frame).loc[4]
    assert over["gemm_ms"] == pytest.approx((10 * 2.0 + 1.0) / 1e3)
    assert over["fixed_ms"] == pytest.approx(over["gemm_ms"] - over["floor_ms"])


def test_a_run_without_tuner_times_gives_an_empty_frame_and_other_runs_are_refused():
    empty = gf.gemm_floor_frame([_side("r1", {})], "r1", num_layers=2, vocab_size=8)
    assert empty.empty and gf.step_overhead(empty).empty
    with pytest.raises(ValueError, match="other runs"):
        gf.gemm_floor_frame([_side("old", {})], "r1", num_layers=2, vocab_size=8)
    with pytest.raises(ValueError, match="num_layers=0"):
        gf.gemm_floor_frame([], "r1", num_layers=0, vocab_size=8)
    with pytest.raises(ValueError, match="use one of"):
        gf.model_dims("llama")
    assert gf.model_dims("qwen3-4b") == {"num_layers": 36, "vocab_size": 151936}


@pytest.mark.skipif(not H200_RUN.exists(), reason="the archived H200 run of 2026-12-07")
def test_the_h200_run_of_2026_12_07_spends_half_a_millisecond_beyond_its_bytes_at_batch_4():
    """The module docstring's numbers, from the archive: at batch 4 the four layer GEMMs cost
    2.8-4.3 us each beyond their bytes at the run's 4.17 TB/s, ~0.53 ms a decode step."""
    point = json.loads(H200_RUN.read_text())["points"][0]
    assert point["tag"] == "nb33_default_fp32_b4"
    frame = gf.gemm_floor_frame([point], point["run_id"], **gf.model_dims("qwen3-4b"))
    layers = frame[(frame["M"] == 4) & (frame["N"] != 151936)]
    assert len(layers) == 4
    assert layers["fixed_us"].between(2.5, 4.5).all()
    assert 0.45 < gf.step_overhead(frame).loc[4, "fixed_ms"] < 0.6
