"""The profile and the graph replay of a flex bench point run at the mean decode context (the
floor's ``prompt + max_new_tokens / 2``), not at the last position a run leaves its state at:
:func:`nbhelpers.bench.profile.rewound_state` and the ``back`` the sweep passes."""

from types import SimpleNamespace

import pytest
import torch

from nbhelpers.bench import flex_sweep
from nbhelpers.bench.profile import rewound_state


def _state():
    return SimpleNamespace(pos=torch.tensor([405, 300, 0]), gen_idx=torch.tensor([255, 150, 0]),
                           tokens=torch.tensor([7, 8, 0]))


def test_rewound_state_moves_back_clamped_and_leaves_the_state_alone():
    st = _state()
    pos, gen, tok = rewound_state(st, 128)
    assert pos.tolist() == [277, 172, 0] and gen.tolist() == [127, 22, 0]
    assert tok.tolist() == [7, 8, 0] and tok.data_ptr() != st.tokens.data_ptr()
    assert rewound_state(st, 400)[0].tolist() == [5, 0, 0]  # clamped at 0
    assert st.pos.tolist() == [405, 300, 0]  # a copy: the state is untouched
    assert [t.tolist() for t in rewound_state(st, 0)] == [[405, 300, 0], [255, 150, 0],
                                                           [7, 8, 0]]
    with pytest.raises(ValueError, match="back=-1 must be >= 0"):
        rewound_state(st, -1)


def test_the_sweep_profiles_and_replays_at_half_the_new_tokens(monkeypatch):
    seen = {}
    monkeypatch.setattr(flex_sweep, "time_rounds", lambda *a, **k: ([{"wall_s": 1.0,
                        "new_tokens": 8, "prompt_tokens": 4}], {"decode_step_ms": 1.0}))
    monkeypatch.setattr(flex_sweep, "replay_ms",
                        lambda llm, batch, back=0: seen.setdefault("replay", back) and None)
    sampling = flex_sweep.SamplingParams(max_new_tokens=512)
    flex_sweep.bench_one(None, [[1, 2]], sampling, rounds=1, warmup=0)
    assert seen["replay"] == 256


def test_run_flex_point_profiles_at_half_the_new_tokens(monkeypatch):
    import transformers

    from nbhelpers import model_configs
    cfg = model_configs.tiny_qwen3()
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    seen = []
    real = flex_sweep.profile_point
    monkeypatch.setattr(flex_sweep, "profile_point",
                        lambda llm, batch, back=0: seen.append(back) or real(llm, batch, back))
    res = flex_sweep.run_flex_point(model, 2, 5, 6, rounds=1, warmup=0, sync_every=2,
                                    profile=True, floor=False)
    assert seen == [3] and res["breakdown"]["aten_ops"]["ops_per_step"] > 0
