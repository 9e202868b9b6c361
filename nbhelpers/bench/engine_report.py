"""Notebook helpers for phase 3 notebooks 30-32: schedule trace, page tables, masks, parity,
sampling statistics. Pure functions over the engine's objects; heavy imports inside.

Contract: every function returns a DataFrame, a dict or a matplotlib Figure (never shows it).
The chi-square test pools categories whose expected count is below ``min_expected`` (5, the usual
validity rule of Pearson's test, e.g. Cochran 1954) into one bin; its p-value is the chi-square
survival function ``Q(dof/2, stat/2)`` (regularised upper incomplete gamma).
"""

from __future__ import annotations

from typing import Any

from nbhelpers.config import SamplingParams


def trace_frame(trace: list[dict[str, Any]]) -> Any:
    """One row per schedule event: kind, sequences, decode steps, free pages, waiting."""
    import pandas as pd
    return pd.DataFrame([{k: e[k] for k in ("event", "kind", "seq_ids", "steps", "free_pages",
                                            "num_waiting")} for e in trace])


def block_table_frame(event: dict[str, Any], page_size: int) -> Any:
    """The page table at one event: per sequence its tokens and physical pages (logical order)."""
    import pandas as pd
    rows = [{"seq_id": sid, "num_tokens": event["num_tokens"][sid], "pages": bt,
             "last_page_fill": event["num_tokens"][sid] - (len(bt) - 1) * page_size}
            for sid, bt in event["block_tables"].items()]
    return pd.DataFrame(rows).set_index("seq_id")


def decode_masks(event: dict[str, Any], num_pages: int, page_size: int) -> tuple[Any, Any]:
    """Token-level ``[B, S]`` and page-level ``[B, num_pages]`` decode masks of one event.

    Built with the engine's own :func:`~nbhelpers.engine.attention.decode_block_mask` for the
    event's block tables, the query being each sequence's last token.
    """
    import torch
    from torch.nn.attention.flex_attention import create_mask

    from nbhelpers.engine.attention import decode_block_mask
    from nbhelpers.engine.kv_cache import phys_to_logical
    tables = list(event["block_tables"].values())
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    pos = torch.tensor([n - 1 for n in event["num_tokens"].values()])
    used = pos // page_size + 1
    p2l = phys_to_logical(bt, used, num_pages)
    bm = decode_block_mask(p2l, bt, used, pos, page_size, num_pages * page_size)
    dense = create_mask(bm.mask_mod, len(tables), 1, 1, num_pages * page_size, device="cpu")
    return dense[:, 0, 0].numpy(), bm.to_dense()[:, 0, 0].numpy()


def mask_figure(token_mask: Any, page_mask: Any, page_size: int) -> Any:
    """Two panels: which physical KV slots each decoding sequence reads, and which pages."""
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 4.5), constrained_layout=True)
    a.imshow(token_mask, aspect="auto", interpolation="nearest", cmap="Greys")
    a.set(title="decode mask over physical KV slots (black = attended)", xlabel="physical slot",
          ylabel="sequence row")
    for x in range(0, token_mask.shape[1] + 1, page_size):
        a.axvline(x - 0.5, color="tab:blue", lw=0.4)
    b.imshow(page_mask, aspect="auto", interpolation="nearest", cmap="Blues")
    b.set(title="BlockMask: pages each row visits (kv_indices = block_table)",
          xlabel="physical page", ylabel="sequence row")
    plt.close(fig)  # the notebook shows the returned figure once
    return fig


def parity_table(named_models: dict[str, Any], prompts_of: dict[str, list[list[int]]],
                 steps: int, **llm_options: Any) -> Any:
    """Greedy engine vs HF forwards per model: token prefix match and max logprob difference."""
    import pandas as pd

    from nbhelpers.bench.flex_sweep import parity
    from nbhelpers.engine import LLM
    rows = {}
    for name, model in named_models.items():
        llm = LLM(model, **llm_options)
        rows[name] = parity(model, llm, prompts_of[name], steps)
    return pd.DataFrame(rows).T


def chi_square(counts: Any, probs: Any, min_expected: float = 5.0) -> dict[str, float]:
    """Pearson chi-square of ``counts`` against ``probs`` with small-expectation pooling.

    Returns ``stat``, ``dof``, ``p_value`` and ``n_bins``; tokens with ``probs == 0`` are excluded
    (and must have zero counts: ``off_support`` counts them).
    """
    import numpy as np
    import torch
    counts, probs = np.asarray(counts, float), np.asarray(probs, float)
    keep = probs > 0
    exp, obs = probs[keep] * counts.sum(), counts[keep]
    big = exp >= min_expected
    exp_b = np.append(exp[big], exp[~big].sum()) if (~big).any() else exp[big]
    obs_b = np.append(obs[big], obs[~big].sum()) if (~big).any() else obs[big]
    stat = float(((obs_b - exp_b) ** 2 / exp_b).sum())
    dof = len(exp_b) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                      torch.tensor(stat / 2.0, dtype=torch.float64)))
    return {"stat": stat, "dof": dof, "p_value": p, "n_bins": len(exp_b),
            "off_support": float(counts[~keep].sum())}


def exact_filtered_probs(logits: Any, sp: SamplingParams) -> Any:
    """The exact processed distribution ``[V]`` of one logits row under ``sp``, computed in
    float32 like the sampler (so that top-k / top-p boundaries between near-tied logits fall
    where the sampler puts them), returned as float64 renormalised."""
    from nbhelpers.engine.sampler import filtered_probs
    from nbhelpers.engine.sampling_tensors import sampling_tensors
    probs = filtered_probs(logits.float().unsqueeze(0), *sampling_tensors(sp, 1))[0]
    probs = probs.double().numpy()
    return probs / probs.sum()


def sampler_draws(logits: Any, sp: SamplingParams, n_draws: int, seed: int = 0,
                  chunk: int = 512) -> Any:
    """``n_draws`` first-token draws of the engine's sampler from one logits row (counts ``[V]``),
    one seed per draw; drawn ``chunk`` rows at a time (a row costs ~10 x V x 8 bytes)."""
    import numpy as np
    import torch

    from nbhelpers.engine.sampler import sample
    from nbhelpers.engine.sampling_tensors import sampling_tensors, uses_sort
    counts = np.zeros(logits.shape[-1], dtype=np.int64)
    for start in range(0, n_draws, chunk):
        n = min(chunk, n_draws - start)
        toks, _ = sample(logits.float().expand(n, -1), *sampling_tensors(sp, n),
                         torch.arange(start, start + n) + seed * n_draws,
                         torch.zeros(n, dtype=torch.long), use_sort=uses_sort(sp))
        counts += np.bincount(toks.numpy(), minlength=logits.shape[-1])
    return counts


def engine_draws(llm: Any, prompt: list[int], sp: SamplingParams, n_total: int,
                 per_call: int = 64) -> Any:
    """First-token counts ``[V]`` from ``LLM.generate`` itself (n samples per call, distinct
    seeds per call), so the whole path (prefill, prefix sharing, sampler) is tested."""
    import numpy as np
    counts = None
    for k in range(-(-n_total // per_call)):
        spk = SamplingParams(**{**sp.to_dict(), "n": per_call, "max_new_tokens": 1,
                                "seed": 10_000 + k * per_call, "ignore_eos": True})
        toks = [o.token_ids[0] for o in llm.generate([prompt], spk)]
        c = np.bincount(toks, minlength=llm.runner.model.config.vocab_size)
        counts = c if counts is None else counts + c
    return counts


def sampling_counts(logits: Any, settings: dict[str, SamplingParams],
                    n_draws: int) -> dict[str, tuple[Any, Any]]:
    """Per setting: ``(counts [V], exact probs [V])`` of ``n_draws`` sampler draws."""
    return {name: (sampler_draws(logits, sp, n_draws), exact_filtered_probs(logits, sp))
            for name, sp in settings.items()}


def sampling_frame(draws: dict[str, tuple[Any, Any]]) -> Any:
    """Per setting: support size, chi-square stat/dof/p, total-variation distance."""
    import numpy as np
    import pandas as pd
    rows = {}
    for name, (counts, exact) in draws.items():
        rows[name] = {"support": int((exact > 0).sum()), **chi_square(counts, exact),
                      "tv_distance": 0.5 * float(np.abs(counts / counts.sum() - exact).sum())}
    return pd.DataFrame(rows).T


def sampling_figure(draws: dict[str, tuple[Any, Any]], top: int = 20) -> Any:
    """Empirical vs exact probability of the ``top`` most likely tokens, one panel per setting."""
    import matplotlib.pyplot as plt
    import numpy as np
    fig, axes = plt.subplots(1, len(draws), figsize=(4 * len(draws), 3),
                             constrained_layout=True, squeeze=False)
    for ax, (name, (counts, exact)) in zip(axes[0], draws.items()):
        order = np.argsort(-exact)[:top]
        ax.bar(np.arange(len(order)) - 0.2, exact[order], width=0.4, label="exact")
        ax.bar(np.arange(len(order)) + 0.2, counts[order] / counts.sum(), width=0.4,
               label="sampled")
        ax.set(title=name, xlabel="token rank", ylabel="probability")
    axes[0][0].legend()
    plt.close(fig)  # the notebook shows the returned figure once
    return fig
