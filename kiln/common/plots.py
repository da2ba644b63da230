"""Small line plots as PNG bytes, for asset metadata, MLflow and the model card.

``line_plot_png({"train loss": [(step, loss), ...]}, "Loss by step", "step", "nats/token")`` -> PNG bytes.
"""

from __future__ import annotations

import io


def _png(fig) -> bytes:
    """The figure as PNG bytes, closed; no version stamp is written, so the same plot gives the same bytes."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def line_plot_png(series: dict[str, list[tuple[float, float]]], title: str, xlabel: str, ylabel: str,
                  bands: dict[str, list[tuple[float, float, float]]] | None = None,
                  hlines: dict[str, float] | None = None) -> bytes:
    """One line per named series of (x, y) points (empty series are left out); ``bands``: shaded (x, low, high)
    ranges (an interval); ``hlines``: dashed horizontal lines (a baseline such as chance). No version stamp is
    written, so the same plot gives the same bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=90)
    for label, pts in series.items():
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="." if len(pts) < 30 else None, label=label)
    for label, pts in (bands or {}).items():
        if pts:
            xs, lo, hi = zip(*pts)
            ax.fill_between(xs, lo, hi, alpha=0.2, label=label)
    for label, y in (hlines or {}).items():
        ax.axhline(y, linestyle="--", color="grey", linewidth=1, label=label)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    return _png(fig)


def interval_plot_png(rows: list[tuple[str, float, float | None, float | None]], title: str, xlabel: str) -> bytes:
    """One horizontal bar per (label, value, low, high): the value as a dot, its interval as a line (left out where
    low is None), and a dashed line at 0: a difference from a baseline and its confidence interval, for each point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 0.9 + 0.35 * max(len(rows), 1)), dpi=90)
    for i, (label, value, low, high) in enumerate(rows):
        if low is not None and high is not None:
            ax.plot([low, high], [i, i], color="tab:blue", linewidth=2)
        ax.plot([value], [i], "o", color="tab:blue")
    ax.axvline(0.0, linestyle="--", color="grey", linewidth=1)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set(title=title, xlabel=xlabel)
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)
