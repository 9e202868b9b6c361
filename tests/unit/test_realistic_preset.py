"""Issue 13 part 5: the realistic GRPO shape is a config preset of 20, accepted by the runner."""

from pathlib import Path

from nbhelpers.run.params import plan_parameters, profiles

REPO = Path(__file__).resolve().parents[2]
NB = REPO / "notebooks" / "phase2_grpo" / "20_grpo_equivalence.ipynb"


def test_realistic_preset_loads_and_passes_the_runners_checks():
    assert "h200_realistic" in profiles(REPO / "configs")
    [(nb, params)] = plan_parameters([NB], "h200_realistic", {}, repo=REPO)
    assert nb == NB and params["model"] == "qwen3-4b"
    assert set(params["backends"]) >= {"flex", "vllm", "hf_generate"}
    # 64 completions a step: micro-batches x accumulation (TRL generates them as one batch)
    completions = params["per_device_train_batch_size"] * params["gradient_accumulation_steps"]
    prompts = completions // params["num_generations"]
    assert completions == 64 and completions % params["num_generations"] == 0
    assert (prompts, params["num_generations"], params["max_completion_length"]) == (8, 8, 512)
    assert params["n_questions"] >= prompts * params["max_steps"]
