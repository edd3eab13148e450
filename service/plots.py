"""Training curves as PNG (matplotlib, headless): reward mean ± std, KL, completion length and held-out eval."""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Protocol

import matplotlib

matplotlib.use("Agg")  # headless: no display on servers

import matplotlib.pyplot as plt  # noqa: E402


class Series(Protocol):
    steps: list[int]
    values: list[float]


def render_metrics_png(series: Mapping[str, Series], *, title: str) -> bytes:
    """Four stacked panels; a metric that was never recorded leaves its panel empty with a note."""
    fig, (ax_reward, ax_kl, ax_len, ax_eval) = plt.subplots(4, 1, figsize=(7, 10), sharex=True)
    fig.suptitle(title)
    reward, std = series.get("reward/mean"), series.get("reward/std")
    if reward is not None and reward.steps:
        ax_reward.plot(reward.steps, reward.values, label="reward mean")
        if std is not None and std.steps == reward.steps:
            low = [m - s for m, s in zip(reward.values, std.values, strict=True)]
            high = [m + s for m, s in zip(reward.values, std.values, strict=True)]
            ax_reward.fill_between(reward.steps, low, high, alpha=0.25, label="± std")
        ax_reward.legend(loc="best")
    _line(ax_reward, None, "reward")
    _line(ax_kl, series.get("kl"), "KL to reference", missing="not recorded (beta = 0: no reference model)")
    _line(ax_len, series.get("completion_length/mean"), "completion length (tokens)")
    _eval_lines(ax_eval, series)
    ax_eval.set_xlabel("step")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def _line(ax: plt.Axes, data: Series | None, label: str, missing: str = "not recorded") -> None:
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    if data is not None and data.steps:
        ax.plot(data.steps, data.values)
    elif not ax.lines:
        ax.text(0.5, 0.5, missing, ha="center", va="center", transform=ax.transAxes, alpha=0.5)


def _eval_lines(ax: plt.Axes, series: Mapping[str, Series]) -> None:
    """Held-out evaluation: accuracy and pass@k when the reward is binary, else the mean reward."""
    names = sorted(n for n in series if n.startswith("eval/") and (n.endswith("/accuracy") or "/pass@" in n))
    if not names and "eval/reward/mean" in series:
        names = ["eval/reward/mean"]
    for name in names:
        if series[name].steps:
            ax.plot(series[name].steps, series[name].values, marker="o", label=name.removeprefix("eval/"))
    # Evaluations of the job's checkpoints (eval_checkpoints), at each checkpoint's step.
    for name in sorted(n for n in series if n.startswith("checkpoint_eval/")):
        if series[name].steps:
            ax.plot(series[name].steps, series[name].values, marker="s", linestyle="--",
                    label=name.replace("checkpoint_eval/", "checkpoint "))
    if ax.lines:
        ax.legend(loc="best")
    _line(ax, None, "held-out eval")
