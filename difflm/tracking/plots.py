"""Plots (PNG) for run directories and MLflow: training curves, the sampler sweep, a data-constrained study."""

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
    """Cloze accuracy and tokens/s against sampler steps (rows from difflm.models.evaluation.sweep.sweep_steps)."""
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


def plot_study(rows: list[dict], path: Path, title: str = "") -> Path | None:
    """A data-constrained study (rows of difflm.tasks.study): validation NLL (or bound) against epochs, one curve per
    family and budget (and size); the best so far (over epochs) against the unique tokens, one curve per family;
    and, where the rows have them, the validation while training of each family and budget's longest point
    against the epochs it had seen (where AR's turns back up as it overfits)."""
    done = [r for r in rows if r.get("validation_nll") not in (None, "")]
    if not done:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    longest: dict[tuple, dict] = {}  # (family, budget, size) -> its point of most epochs with a training curve
    for r in done:
        key = (r["family"], r["unique_tokens"], r["size"])
        if r.get("curve") and r["epochs"] > longest.get(key, {}).get("epochs", 0):
            longest[key] = r
    fig, axes = plt.subplots(1, 3 if longest else 2, figsize=(16.5 if longest else 11, 4.2), dpi=110)
    a1, a2 = axes[0], axes[1]
    curves: dict[tuple, list[tuple[float, float]]] = {}
    for r in done:
        curves.setdefault((r["family"], r["unique_tokens"], r["size"]), []).append((r["epochs"], r["validation_nll"]))
    many_sizes = len({k[2] for k in curves}) > 1
    for (family, budget, size), pts in sorted(curves.items()):
        label = f"{family}, {budget:,} tokens" + (f", {size}" if many_sizes else "")
        a1.plot(*zip(*sorted(pts)), "o-", label=label)
    a1.set_xscale("log")
    a1.set_xlabel("epochs over the unique tokens")
    a1.set_ylabel("validation nats / token (bound for diffusion)")
    best: dict[tuple, dict[int, float]] = {}
    for r in done:
        per = best.setdefault((r["family"], r["size"]), {})
        per[r["unique_tokens"]] = min(per.get(r["unique_tokens"], float("inf")), r["validation_nll"])
    for (family, size), per in sorted(best.items()):
        a2.plot(*zip(*sorted(per.items())), "o-", label=family + (f", {size}" if many_sizes else ""))
    a2.set_xscale("log")
    a2.set_xlabel("unique training tokens")
    a2.set_ylabel("best validation nats / token over epochs")
    for (family, budget, size), r in sorted(longest.items()):
        label = f"{family}, {budget:,} tokens, {r['epochs']:g} epochs" + (f", {size}" if many_sizes else "")
        axes[2].plot([c[1] for c in r["curve"]], [c[2] for c in r["curve"]], ".-", label=label)
    if longest:
        axes[2].set_xscale("log")
        axes[2].set_xlabel("epochs seen while training (longest point)")
        axes[2].set_ylabel("validation nats / token while training")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
