"""nbhelpers.stats: sidecar round trip, NaN/inf -> None, validation errors, summaries."""

import json
import math
import re

import pytest
import torch

from nbhelpers import stats


def _side(**kw):
    return stats.make_sidecar(phase="phase1", backend="hf_generate",
                              model={"name": "tiny-llama", "weights": "random"},
                              rounds=[{"wall_s": 2.0, "new_tokens": 100, "prompt_tokens": 40},
                                      {"wall_s": 4.0, "new_tokens": 100, "prompt_tokens": 40}],
                              peak_mem={"allocated": 1.5, "device": float("inf")}, **kw)


def test_sidecar_round_trip(tmp_path):
    side = _side(extra={"note": "x", "nested": {"v": float("nan"), "xs": [1.0, float("-inf")]}})
    path = stats.write_sidecar(side, tmp_path / "a" / "run.json")
    assert not list(path.parent.glob("*.tmp*"))  # atomic write left no temp file
    back = stats.read_sidecars(tmp_path)
    assert len(back) == 1 and back[0]["_path"] == str(path)
    assert {k: v for k, v in back[0].items() if k != "_path"} == json.loads(path.read_text())
    assert back[0]["decode_tok_per_s_median"] == pytest.approx(37.5)  # median(50, 25)
    assert back[0]["prompt_tok_per_s_median"] == pytest.approx(15.0)
    assert back[0]["wall_s_median"] == 3.0
    assert back[0]["peak_mem_allocated_gib"] == 1.5


def test_non_finite_values_become_none(tmp_path):
    side = _side(extra={"nested": {"v": float("nan"), "xs": [1.0, float("-inf")]}})
    assert side["peak_mem_device_gib"] is None
    assert side["nested"] == {"v": None, "xs": [1.0, None]}
    text = stats.write_sidecar(side, tmp_path / "s.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert [stats.finite_or_none(x) for x in (None, "a", "2", float("nan"), 3)] == \
        [None, None, 2.0, None, 3.0]


def test_validate_names_missing_keys_and_schema():
    side = _side()
    stats.validate_sidecar(side)
    broken = {k: v for k, v in side.items() if k not in ("rounds", "env")}
    with pytest.raises(ValueError, match=r"missing \['rounds', 'env'\].*make_sidecar"):
        stats.validate_sidecar(broken)
    with pytest.raises(ValueError, match="schema=2"):
        stats.validate_sidecar({**side, "schema": 2})
    with pytest.raises(ValueError):
        stats.write_sidecar(broken, "/nonexistent/never-written.json")


def test_extra_cannot_overwrite_schema_keys():
    with pytest.raises(ValueError, match=r"overwrite schema keys \['error', 'phase'\]"):
        _side(extra={"phase": "x", "error": "y"})


def test_read_sidecars_skips_invalid_and_filters_phase(tmp_path):
    stats.write_sidecar(_side(), tmp_path / "ok.json")
    stats.write_sidecar(stats.make_sidecar(phase="phase0", backend="x"), tmp_path / "p0.json")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"schema": 1}))
    (tmp_path / "list.json").write_text(json.dumps([1, 2]))  # e.g. a prompt-id file
    assert len(stats.read_sidecars(tmp_path)) == 2
    with pytest.raises(ValueError, match="JSON list"):
        stats.validate_sidecar([1, 2])
    assert [s["phase"] for s in stats.read_sidecars(tmp_path, phase="phase0")] == ["phase0"]


def test_median_percentile_ignore_non_finite():
    assert stats.median([3.0, float("nan"), 1.0, 2.0]) == 2.0
    assert stats.median([1.0, 2.0, 3.0, 4.0]) == 2.5
    assert stats.median([float("nan")]) is None
    assert stats.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert stats.percentile([], 50) is None


def test_labels_and_timer():
    assert re.fullmatch(r"\d{8}T\d{6}Z", stats.utc_stamp())
    assert stats.device_tag("NVIDIA H200") == "h200" and stats.device_tag("cpu") == "cpu"
    assert stats.device_tag("Some Odd GPU 9000") == "someoddgpu9000"
    with stats.timer() as t:
        sum(range(1000))
    assert t["s"] >= 0
    on_gpu = torch.cuda.is_available()
    if on_gpu:  # the CUDA peak counts this process's tensors only: make sure there is one
        keep = torch.ones(1024, device="cuda")  # noqa: F841
    mem = stats.peak_memory_gib()
    assert mem["allocated"] > 0 and math.isfinite(mem["device"])
    info = stats.env_info()
    assert info["gpu"] == (torch.cuda.get_device_name(0) if on_gpu else "cpu")
    assert stats.device_tag() == stats.device_tag(info["gpu"])
    assert info["torch"] and info["git_sha"]


def test_rounds_summary_rates_a_grpo_round_over_its_rollout_seconds():
    rounds = [{"wall_s": 30.0, "generate_s": 10.0, "new_tokens": 400, "prompt_tokens": 200},
              {"wall_s": 30.0, "generate_s": None, "new_tokens": 400, "prompt_tokens": 200}]
    got = stats.rounds_summary(rounds)
    assert got["decode_tok_per_s_median"] == pytest.approx(40.0)  # the untimed round left out
    assert got["prompt_tok_per_s_median"] == pytest.approx(20.0)
    assert got["wall_s_median"] == 30.0
    assert stats.rounds_summary(rounds[1:])["decode_tok_per_s_median"] is None


def test_run_id_is_the_runners_stamp_when_it_set_one(monkeypatch):
    monkeypatch.setenv(stats.RUN_ID_ENV, "20261207T160121Z")
    assert _side()["run_id"] == "20261207T160121Z" and _side(run_id="x")["run_id"] == "x"
    monkeypatch.delenv(stats.RUN_ID_ENV)
    assert re.fullmatch(r"\d{8}T\d{6}Z", _side()["run_id"])
