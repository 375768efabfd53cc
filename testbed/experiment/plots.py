"""Plots of experiment results (matplotlib; Figures returned, PNGs written on request).

Every plot draws the measurement (markers + solid line, mean over repetitions with min–max
bars) and the α-β model's prediction for the same runs beside it (dashed line, same colour),
so a reader sees at once how far the emulation is from the model.

The plotting functions never choose matplotlib's backend: in a notebook the user's backend
(``inline``, ``widget``, ...) shows the figures, and switching it would close them. Command-line
entry points call :func:`use_headless` first, so they write PNGs without a display.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

#: y columns the plots know how to pair with a model prediction.
_MODEL_OF = {"time_s": "model_s"}
_LABELS = {"time_s": "time (s)", "busbw": "bus bandwidth (Gb/s)", "algbw": "alg bandwidth (Gb/s)",
           "bytes": "message size (bytes)", "n": "workers (n)", "max_abs_err": "max |error|",
           "fidelity": "measured / model"}


def in_ipython() -> bool:
    """Whether this process runs an IPython shell or a Jupyter kernel."""
    shell = sys.modules.get("IPython")
    return shell is not None and getattr(shell, "get_ipython", lambda: None)() is not None


def use_headless() -> None:
    """Select the Agg backend for a command-line run (PNG files, no display needed).

    Does nothing inside IPython/Jupyter: there the backend is the user's choice.
    """
    if in_ipython():
        return
    import matplotlib  # here, not at the top: see _pyplot

    matplotlib.use("Agg")


def _pyplot():
    # Imported on first use: pandas-only users of the results never pay for matplotlib.
    import matplotlib.pyplot as plt

    return plt


def model_column(df, y: str):
    """The model's prediction for column ``y`` of each row, or None when there is none.

    time_s -> model_s; busbw/algbw scale by time_s/model_s (same bytes, model's time).
    """
    if y in _MODEL_OF and _MODEL_OF[y] in df.columns:
        return df[_MODEL_OF[y]]
    if y in ("busbw", "algbw") and {"time_s", "model_s"} <= set(df.columns):
        return df[y] * df["time_s"] / df["model_s"]
    return None


def plot_metric(df, x: str = "bytes", y: str = "time_s", hue: str = "label",
                out: str | Path | None = None, ax=None, title: str | None = None,
                model: bool = True, logx: bool | None = None, logy: bool = False):
    """Plot ``y`` against ``x``, one line per ``hue`` value, with the model dashed beside it.

    Returns the matplotlib Figure; writes a PNG to ``out`` when given.
    """
    for col, what in ((x, "x"), (y, "y")):
        if col not in df.columns:
            raise ValueError(f"{what}={col!r} is not a results column; columns: "
                             f"{', '.join(map(str, df.columns))}")
    plt = _pyplot()
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
    else:
        fig = ax.figure
    data = df.copy()
    mcol = model_column(data, y) if model else None
    if mcol is not None:
        data["__model"] = mcol
    groups = data.groupby(hue, sort=False) if hue in data.columns else [(y, data)]
    for i, (key, g) in enumerate(groups):
        color = f"C{i % 10}"
        agg = g.groupby(x)[y].agg(["mean", "min", "max"]).sort_index()
        xs = agg.index.to_numpy()
        ax.errorbar(xs, agg["mean"], yerr=[agg["mean"] - agg["min"], agg["max"] - agg["mean"]],
                    fmt="o-", color=color, label=f"{key} measured", capsize=3)
        if "__model" in g.columns and g["__model"].notna().any():
            m = g.groupby(x)["__model"].mean().sort_index()
            ax.plot(m.index.to_numpy(), m.to_numpy(), "--", color=color, alpha=0.8,
                    label=f"{key} model")
    if logx is None:
        logx = x == "bytes" and data[x].nunique() > 1 and data[x].max() / data[x].min() >= 8
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(_LABELS.get(x, x))
    ax.set_ylabel(_LABELS.get(y, y))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    if out is not None:
        fig.tight_layout()
        fig.savefig(out, dpi=110)
    return fig


def plot_overview(df, x: str = "bytes", out: str | Path | None = None, hue: str = "label",
                  title: str | None = None):
    """Time and bus bandwidth against ``x`` side by side (model dashed); returns the Figure."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    plot_metric(df, x=x, y="time_s", hue=hue, ax=axes[0])
    plot_metric(df, x=x, y="busbw", hue=hue, ax=axes[1])
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if out is not None:
        fig.savefig(out, dpi=110)
    return fig


def plot_bars(df, y: str = "time_s", hue: str = "label", out: str | Path | None = None,
              title: str | None = None, model: bool = True, ax=None) -> Any:
    """One bar per ``hue`` value (mean of ``y``), the model's value as a hatched bar beside it."""
    plt = _pyplot()
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
    else:
        fig = ax.figure
    data = df.copy()
    mcol = model_column(data, y) if model else None
    labels = list(dict.fromkeys(data[hue]))
    means = [data.loc[data[hue] == k, y].mean() for k in labels]
    xs = range(len(labels))
    width = 0.38 if mcol is not None else 0.7
    ax.bar([i - (width / 2 if mcol is not None else 0) for i in xs], means, width,
           label="measured", color=[f"C{i % 10}" for i in xs])
    if mcol is not None:
        data["__model"] = mcol
        mm = [data.loc[data[hue] == k, "__model"].mean() for k in labels]
        ax.bar([i + width / 2 for i in xs], mm, width, label="model", fill=False, hatch="//",
               edgecolor=[f"C{i % 10}" for i in xs])
    ax.set_xticks(list(xs), labels, rotation=15)
    ax.set_ylabel(_LABELS.get(y, y))
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    if title:
        ax.set_title(title)
    if out is not None:
        fig.tight_layout()
        fig.savefig(out, dpi=110)
    return fig


def plot_ratios(df, label: str = "label", y: str = "ratio", out: str | Path | None = None,
                title: str | None = None, anchor: str = "anchor") -> Any:
    """Horizontal bars of ``y`` (a ratio against an anchor measured in the same run) per
    ``label``, drawn from the anchor's 1 on a log axis (ratios multiply: 0.5 and 2 are equally
    far from the anchor); rows without a positive ratio are left out."""
    plt = _pyplot()
    data = df[df[y].notna()]
    values = data[y].astype(float)
    data, values = data[values > 0], values[values > 0]
    labels = [str(v) for v in data[label]]
    fig, ax = plt.subplots(figsize=(7.5, 0.8 + 0.32 * max(len(labels), 1)))
    ax.barh(range(len(labels)), values - 1.0, left=1.0,
            color=["C2" if v >= 1 else "C3" for v in values])
    ax.set_xscale("log")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=1, ls="--", label=f"{anchor} = 1")
    ax.set_xlabel(f"{y} (log scale, higher is better)")
    ax.legend(fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    if out is not None:
        fig.savefig(out, dpi=110)
    return fig


# -- the fabric of one run -----------------------------------------------------------------

#: drawing level of each switch role (hosts at 0): the datacenter's layers, bottom to top
_LEVEL = {"smartnic": 0.5, "tor": 1, "leaf": 1, "edge": 1, "agg": 2, "spine": 2, "core": 3}


def link_traffic(describe: dict, delta: dict[str, float]) -> list[dict]:
    """What crossed each link of a topology during a run: ``describe`` is the network's
    ``describe()``, ``delta`` its flattened counters' change over the run (the results
    folder's ``counters/runNNNN.json``). Read at each link's switch end (a host's end is in
    its namespace): ``bytes_ab``/``bytes_ba`` each way, ``drops``, and the rate and role."""
    switches = set(describe["switches"])
    out = []
    for ln in describe["links"]:
        a, b = ln["a"], ln["b"]
        side, port = (b, ln["port_b"]) if b in switches else (a, ln["port_a"])
        stat = {k: delta.get(f"ports.{side}-eth{port}.{k}", 0.0)
                for k in ("rx_bytes", "tx_bytes", "rx_dropped", "tx_dropped")}
        into, out_of = stat["rx_bytes"], stat["tx_bytes"]  # at ``side``
        out.append({"a": a, "b": b, "role": ln.get("role"), "bw_mbps": ln.get("bw_mbps"),
                    "bytes_ab": into if side == b else out_of,
                    "bytes_ba": out_of if side == b else into,
                    "drops": stat["rx_dropped"] + stat["tx_dropped"]})
    return out


def fabric_positions(describe: dict) -> dict[str, tuple[float, float]]:
    """Node -> (x, y): hosts at the bottom, each switch at its role's level (ToR/leaf/edge,
    aggregation/spine, core), every level spread over the same width."""
    levels: dict[float, list[str]] = {0: list(describe["hosts"])}
    for name, role in describe["switches"].items():
        levels.setdefault(_LEVEL.get(role, 1), []).append(name)
    width = max(len(v) for v in levels.values())
    return {name: ((i + 0.5) * width / len(names), y)
            for y, names in levels.items() for i, name in enumerate(names)}


def draw_fabric_nodes(ax, describe: dict, pos: dict[str, tuple[float, float]]) -> None:
    """The nodes at ``pos`` (:func:`fabric_positions`): hosts as circles named below,
    switches as squares named above, programmable ones filled."""
    prog = set(describe.get("programmable", []))
    for name, (x, y) in pos.items():
        host = name in describe["hosts"]
        ax.scatter([x], [y], s=120 if host else 260, marker="o" if host else "s", zorder=2,
                   color="white" if host or name not in prog else "#9ecae1",
                   edgecolors="black")
        ax.text(x, y - 0.22 if host else y + 0.22, name, fontsize=7, ha="center",
                va="top" if host else "bottom")


def plot_fabric(describe: dict, delta: dict[str, float], seconds: float | None = None,
                out: str | Path | None = None, title: str | None = None, ax=None):
    """The fabric as a datacenter is drawn, each link coloured and sized by the bytes that
    crossed it (both ways; with ``seconds``, by its utilisation over them) and labelled with
    them, drops in red; programmable switches filled. Returns the Figure."""
    plt = _pyplot()
    import matplotlib
    from matplotlib import cm, colors

    pos = fabric_positions(describe)
    traffic = link_traffic(describe, delta)
    fig = ax.figure if ax is not None else plt.figure(figsize=(
        max(6.0, 0.6 * max(len(describe["hosts"]), 8)), 4.2))
    ax = ax or fig.add_subplot()

    def load(t: dict) -> float:
        peak = max(t["bytes_ab"], t["bytes_ba"])
        if seconds and t["bw_mbps"]:
            return peak * 8 / (t["bw_mbps"] * 1e6 * seconds)
        return peak

    top = max((load(t) for t in traffic), default=0.0) or 1.0
    norm = colors.Normalize(0.0, 1.0 if seconds else top)
    cmap = matplotlib.colormaps["viridis_r"]
    for t in traffic:
        (xa, ya), (xb, yb) = pos[t["a"]], pos[t["b"]]
        v = load(t)
        ax.plot([xa, xb], [ya, yb], color=cmap(norm(v)), lw=1 + 5 * v / top, zorder=1,
                solid_capstyle="round")
        total = t["bytes_ab"] + t["bytes_ba"]
        if total or t["drops"]:
            label = f"{total / 1e6:.2f} MB" + (f"\n{v:.0%}" if seconds else "")
            if t["drops"]:
                label += f"\n{int(t['drops'])} dropped"
            ax.text((xa + xb) / 2, (ya + yb) / 2, label, fontsize=6, ha="center",
                    va="center", color="red" if t["drops"] else "black", zorder=3,
                    bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none",
                          "alpha": 0.7})
    draw_fabric_nodes(ax, describe, pos)
    sm = cm.ScalarMappable(norm=norm, cmap=cmap)
    fig.colorbar(sm, ax=ax, label="utilisation of the busier direction" if seconds
                 else "bytes on the busier direction", fraction=0.04)
    ax.set_axis_off()
    ax.set_ylim(-0.45, max(y for _, y in pos.values()) + 0.45)
    ax.set_title(title or f"{describe['kind']}: bytes per link over the run", fontsize=9,
                 pad=12)
    if out is not None:
        fig.savefig(out, dpi=100, bbox_inches="tight")
    return fig
