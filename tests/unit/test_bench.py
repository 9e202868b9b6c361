"""nbhelpers.bench.rollout: failure isolation (one backend fails or times out, the others still report),
token counting, sidecars, the bandwidth limit and the comparison table. Tiny model
``tiny-qwen3``; each backend runs in its own subprocess (~15 s each on 2 cores). Run:
``pytest tests/unit/test_bench.py -q``.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest

from nbhelpers import models
from nbhelpers.backends.base import Completion
from nbhelpers.bench import rollout as bench
from nbhelpers.bench.worker import count_round, lora_from_block, warmup_sampling
from nbhelpers.config import LoraSpec, SamplingParams, Workload
from nbhelpers.stats import validate_sidecar

PROMPTS = [[5, 6, 7, 8, 9, 10] * 3, [11, 12, 13] * 4]
WORK = Workload(n_prompts=2, max_new_tokens=6, rounds=2, warmup_rounds=1)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    models.fetch_assets("tiny-qwen3")
    out = tmp_path_factory.mktemp("phase1")
    opts = {"hf_generate": {"rounds": 1, "warmup_max_new_tokens": 2},
            "hf_cb": {"timeout_s": 0.5}}
    sides = bench.run_backends(["hf_generate", "vllm", "hf_cb"], "tiny-qwen3",
                               LoraSpec(rank=4, alpha=8), WORK, out, opts, prompts=PROMPTS,
                               run_id="test", progress=False)
    return out, sides


def test_every_backend_gets_a_valid_sidecar(sweep):
    out, sides = sweep
    assert [s["backend"] for s in sides] == ["hf_generate_lora", "vllm_lora", "hf_cb_lora"]
    for s in sides:
        validate_sidecar(s)
        assert s["phase"] == "phase1" and s["lora"]["rank"] == 4
    assert len(list(out.glob("test_*_lora.json"))) == 3


def test_success_counts_returned_tokens(sweep):
    ok = sweep[1][0]
    assert ok["error"] is None and len(ok["rounds"]) == 1
    r = ok["rounds"][0]
    assert r["new_tokens"] == 2 * 6 and r["prompt_tokens"] == 18 + 12 and r["wall_s"] > 0
    assert ok["decode_tok_per_s_median"] == pytest.approx(12 / r["wall_s"])
    assert ok["warmup_max_new_tokens"] == 2 and ok["init_s"] > 0
    assert ok["workload"]["prompt_tokens_mean"] == 15 and ok["versions"]["torch"]


def test_missing_engine_and_timeout_are_recorded(sweep):
    _, (_, missing, slow) = sweep
    assert "BackendNotInstalled" in missing["error"] and ".[vllm]" in missing["error"]
    assert missing["rounds"] == [] and missing["decode_tok_per_s_median"] is None
    assert slow["error"].startswith("timeout after") and slow["rounds"] == []


def test_unknown_backend_fails_before_running(tmp_path):
    with pytest.raises(ValueError, match="unknown backend"):
        bench.run_backends(["hf_generate", "nope"], "tiny-qwen3", None, WORK, tmp_path,
                           prompts=PROMPTS)


def test_count_round_and_warmup_sampling():
    comps = [Completion([1], [2, 3], None, "length"), Completion([1], [4], None, "stop")]
    assert count_round([[1]], comps, n=2) == {"new_tokens": 3, "prompt_tokens": 2}
    with pytest.raises(RuntimeError, match="2 completions"):
        count_round([[1], [2]], comps, n=2)
    sp = SamplingParams(max_new_tokens=512, min_p=0.1)
    assert warmup_sampling(sp, 32).max_new_tokens == 32 and warmup_sampling(sp, None) is sp
    assert lora_from_block({"rank": 8, "alpha": 16, "targets": ["q_proj"], "b_std": 0.01}) == \
        LoraSpec(rank=8, alpha=16, targets=("q_proj",))


def test_decode_limit_for_workload_w():
    cfg, n = models.build_config("qwen3-4b"), models.n_params("qwen3-4b")
    assert bench.lora_param_count(cfg, LoraSpec()) == 66_060_288
    at_peak = bench.decode_limit_tok_per_s(cfg, n, 32, 151.1, 512, bandwidth_bytes_per_s=4.8e12)
    assert at_peak == pytest.approx(15_400, rel=0.01)  # research/anchors.md section 0
    measured = bench.decode_limit_tok_per_s(cfg, n, 32, 151.1, 512)
    with_lora = bench.decode_limit_tok_per_s(cfg, n, 32, 151.1, 512, lora=LoraSpec())
    assert 13_000 < with_lora < measured < 14_500


def test_comparison_table_percentages():
    frame = pd.DataFrame({"backend": ["vllm", "hf_cb", "vllm_lora", "hf_cb_lora"],
                          "engine": ["vllm", "hf_cb", "vllm", "hf_cb"],
                          "lora": [False, False, True, True],
                          "decode_tok_per_s": [6000.0, 600.0, 5000.0, None]})
    table = bench.comparison_table(frame, {False: 12000.0})
    assert table["pct_of_vllm"].tolist()[:3] == [100.0, 10.0, 100.0]
    assert math.isnan(table["pct_of_vllm"].iloc[3])
    assert table["pct_of_limit"].iloc[1] == pytest.approx(5.0)
    assert math.isnan(table["pct_of_limit"].iloc[2])
    fig = bench.bar_figure(table, ["decode_tok_per_s"], "tok/s", "decode")
    assert len(fig.axes[0].patches) == 4


def test_result_line_names_a_missing_vllm_row_instead_of_nan():
    frame = pd.DataFrame({"backend": ["hf_generate_lora", "hf_cb_lora"],
                          "engine": ["hf_generate", "hf_cb"], "lora": [True, True],
                          "decode_tok_per_s": [20.0, 47.0]})
    line = bench.result_line(bench.comparison_table(frame, {True: 4700.0}))
    assert "hf_cb_lora is fastest at 47 tok/s" in line and "no vLLM row in this run" in line
    assert "nan" not in line
