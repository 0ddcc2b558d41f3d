"""Matplotlib figures for the benchmark reports (Agg backend: files only, no display)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.stats import TTFT_SLO_S, Outcome, rolling_percentile  # noqa: E402

CLASS_COLOURS = {
    "reserved": "tab:green",
    "standard": "tab:blue",
    "best_effort": "tab:orange",
    "noisy": "tab:red",
}


@dataclass(slots=True)
class Series:
    """One line: x and y arrays and a label."""

    label: str
    x: Sequence[float] | np.ndarray
    y: Sequence[float] | np.ndarray
    style: dict[str, object] = field(default_factory=dict)


def _finish(fig: plt.Figure, path: Path, caption: str) -> Path:
    fig.text(0.01, 0.005, caption, fontsize=7, color="dimgray", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def arms_timeseries(
    arms: Mapping[str, tuple[Sequence[Outcome], Mapping[str, tuple[np.ndarray, np.ndarray]]]],
    group_of: Mapping[str, str],
    path: Path,
    caption: str,
    window_s: float = 20.0,
) -> Path:
    """Per arm: rolling TTFT p95 by group (left) and KV occupancy per replica (right).

    ``arms`` maps arm name → (outcomes, {replica_id: (t_model_s, occupancy)}).
    ``group_of`` maps tenant id → the group its line is drawn in (class, or "noisy").
    """
    n = len(arms)
    fig, axes = plt.subplots(n, 2, figsize=(13, 2.9 * n), squeeze=False, sharex="col")
    for row, (arm, (outcomes, occupancy)) in enumerate(arms.items()):
        ax_t, ax_k = axes[row]
        by_group: dict[str, list[Outcome]] = {}
        for o in outcomes:
            by_group.setdefault(group_of.get(o.tenant_id, o.admission_class), []).append(o)
        for group, outs in sorted(by_group.items()):
            done = [o for o in outs if o.ttft_s is not None]
            if not done:
                continue
            ts = [o.sent_s for o in done]
            vals = [o.ttft_s for o in done]
            ax_t.scatter(ts, vals, s=3, alpha=0.25, color=CLASS_COLOURS.get(group, "gray"))
            gx, gy = rolling_percentile(ts, vals, window_s, 95, max(1.0, window_s / 8))  # type: ignore[arg-type]
            ax_t.plot(gx, gy, color=CLASS_COLOURS.get(group, "gray"), label=f"{group} p95")
        ax_t.axhline(TTFT_SLO_S, color="black", lw=0.8, ls="--")
        ax_t.set_yscale("log")
        ax_t.set_ylabel(f"{arm}\nTTFT s (model)")
        ax_t.legend(fontsize=7, loc="upper left")
        for rid, (tx, occ) in sorted(occupancy.items()):
            ax_k.plot(tx, np.asarray(occ) * 100, lw=0.9, label=rid)
        for level in (60, 85, 92):
            ax_k.axhline(level, color="gray", lw=0.6, ls=":")
        ax_k.set_ylim(0, 102)
        ax_k.set_ylabel("KV occupancy %")
        ax_k.legend(fontsize=6, loc="upper left", ncol=2)
    axes[-1][0].set_xlabel("request sent at (model s)")
    axes[-1][1].set_xlabel("model s")
    return _finish(fig, path, caption)


def lines(
    panels: Sequence[tuple[str, Sequence[Series]]],
    path: Path,
    caption: str,
    xlabel: str = "",
    logy: Sequence[bool] | None = None,
    hlines: Sequence[Sequence[float]] | None = None,
) -> Path:
    """A column of panels, each (ylabel, series)."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.8 * len(panels)), squeeze=False)
    for i, (ylabel, series) in enumerate(panels):
        ax = axes[i][0]
        for s in series:
            ax.plot(s.x, s.y, label=s.label, **s.style)
        if hlines and i < len(hlines):
            for h in hlines[i]:
                ax.axhline(h, color="black", lw=0.7, ls="--")
        if logy and i < len(logy) and logy[i]:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel(xlabel)
    return _finish(fig, path, caption)
