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
    """Exact match of the generated word and tokens/s against tokens per forward (TPF), one point per decoding
    setting (rows from difflm.models.evaluation.sweep.sweep_steps)."""
    if not rows:
        return None
    points = [
        {
            "label": r.get("setting", f"steps {r['steps']}"),
            "accuracy": r["accuracy"],
            "tpf": r.get("tpf"),
            "tokens_per_s": r.get("tokens_per_s"),
            "ar": False,
        }
        for r in rows
    ]
    return plot_parallelism(points, path, title)


def plot_parallelism(points: list[dict], path: Path, title: str = "", speed: bool = True) -> Path | None:
    """Accuracy against TPF and (`speed`) against tokens/s: one point per decoding setting ({label, accuracy, tpf,
    tokens_per_s, ar}), the AR rows marked apart. Without `speed` (records from different machines: tokens/s
    do not compare) the TPF panel alone."""
    pts = [p for p in points if p.get("accuracy") is not None and p.get("tpf")]
    if not pts:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("tpf", "tokens per forward (TPF)")] + ([("tokens_per_s", "valid tokens / s")] if speed else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), dpi=110, squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        for ar in (False, True):
            sel = [p for p in pts if bool(p.get("ar")) == ar and p.get(key)]
            if sel:
                ax.scatter(
                    [p[key] for p in sel],
                    [p["accuracy"] for p in sel],
                    marker="s" if ar else "o",
                    color="tab:red" if ar else "tab:blue",
                    label="AR (KV cache)" if ar else "diffusion",
                )
            for p in sel:
                ax.annotate(p["label"], (p[key], p["accuracy"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel(label)
        ax.set_ylabel("exact match (generated word)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
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
