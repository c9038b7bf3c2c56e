"""Training-curve plot (PNG) for the run directory and MLflow: a picture of loss and validation."""

from __future__ import annotations

from pathlib import Path


def plot_curves(records: list[dict], path: Path, title: str = "") -> Path | None:
    """Plot `loss` and `val_loss` against the step from metrics.jsonl records; None if nothing to plot."""
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if not train and not val:
        return None
    # matplotlib is loaded here, not at import: its backend must be set to Agg before pyplot loads, and a
    # process that only imports this module (the launcher, the CLI) neither pays for it nor has its backend set
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1, alpha=0.7)
    if val:
        ax.plot(*zip(*val), "o-", label="validation (ELBO for diffusion, NLL for ar)", lw=2)
    ax.set_xlabel("iteration")
    ax.set_ylabel("nats / token")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_sweep(rows: list[dict], path: Path, title: str = "") -> Path | None:
    """Cloze accuracy and tokens/s against sampler steps (rows from models.evaluation.sweep.sweep_steps)."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["steps"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=110)
    a1.plot(steps, [r["accuracy"] for r in rows], "o-")
    a1.set_xlabel("sampler steps")
    a1.set_ylabel("cloze accuracy (generated word)")
    a2.plot(steps, [r["tokens_per_s"] for r in rows], "o-", color="tab:orange")
    a2.set_xlabel("sampler steps")
    a2.set_ylabel("generated tokens / s")
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
