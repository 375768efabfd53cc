"""Draw docs/images/architecture.svg, the README's architecture diagram (``make docs-images``).

Left: the layers of the package and what each owns (each imports only those below it).
Right: what one experiment run builds: a Mininet star whose hosts run the collective's worker
processes and whose programmable switch is one data-path engine running its stages on
batches of real packets. Plain matplotlib, so the picture regenerates anywhere the testbed
installs; the SVG is written without a date, so an unchanged drawing gives unchanged bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # a script, never a notebook: write files, open no window
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parent / "architecture.svg"

LAYERS = [  # (title, import name, what it owns, colour)
    ("notebooks/, experiments/", "", "experiments a person reads, runs and plots", "#f2f2f2"),
    ("experiment", "testbed.experiment", "declarative experiment → runs → tidy results,\n"
     "model next to every measurement, provenance", "#dbe9f6"),
    ("collectives", "testbed.collectives", "ring, halving-doubling, reduction server, INA,\n"
     "NIC offload; flow-level and α-β models", "#d5ecd4"),
    ("topologies", "testbed.topologies", "star, leaf-spine, fat-tree, dumbbell, incast;\n"
     "pipelines of the programmable nodes", "#fbe3c8"),
    ("datapath", "testbed.datapath", "userspace switch / SmartNIC engine: batched\n"
     "AF_PACKET I/O, stages, control channel", "#f6d5d5"),
    ("kernels", "testbed.kernels", "Numba kernels + numpy twins: wire format, packets,\n"
     "fixed point, compressors, trimming", "#e6dcf0"),
]


def box(ax, x, y, w, h, color, lw=1.0, ec="#555555", radius=0.012):
    """A rounded rectangle with its lower-left corner at (x, y)."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=f"round,pad=0,rounding_size={radius}",
                                fc=color, ec=ec, lw=lw))


def arrow(ax, a, b, color="#444444", style="-|>", lw=1.2, rad=0.0, ls="-"):
    """An arrow from point a to point b."""
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=11, color=color, lw=lw,
                                 connectionstyle=f"arc3,rad={rad}", linestyle=ls))


def layers(ax):
    """The package's layers, top to bottom, with what each owns."""
    x, w, h, gap, top = 0.02, 0.40, 0.112, 0.018, 0.785
    ax.text(x, 0.94, "the package", fontsize=13, weight="bold")
    for k, (title, mod, what, color) in enumerate(LAYERS):
        y = top - k * (h + gap)
        box(ax, x, y, w, h, color)
        ax.text(x + 0.012, y + h - 0.03, title, fontsize=10.5, weight="bold", va="center")
        if mod:
            ax.text(x + w - 0.012, y + h - 0.03, mod, fontsize=8.5, va="center", ha="right",
                    family="monospace", color="#333333")
        ax.text(x + 0.012, y + 0.038, what, fontsize=8.3, va="center", color="#222222",
                linespacing=1.25)
    ax.text(x + w / 2, top - (len(LAYERS) - 1) * (h + gap) - 0.045,
            "each layer imports only the layers below it", fontsize=8.3, ha="center",
            style="italic", color="#555555")


def network(ax):
    """One run: hosts, the programmable switch and its stages, the control channel."""
    x0 = 0.48
    ax.text(x0, 0.94, "one run: an emulated network (Mininet, real packets)", fontsize=13,
            weight="bold")
    # the programmable switch and its engine
    sx, sy, sw, sh = 0.60, 0.415, 0.27, 0.25
    box(ax, sx, sy, sw, sh, "#f6d5d5", lw=1.4)
    ax.text(sx + sw / 2, sy + sh - 0.03, "programmable switch tbs1", fontsize=10, weight="bold",
            ha="center")
    ax.text(sx + sw / 2, sy + sh - 0.065, "testbed.datapath engine: frame batches → @njit stages",
            fontsize=7.6, ha="center", color="#333333")
    stages = ["impair", "aggregate", "forward", "trim"]
    bw, bh, by = 0.056, 0.055, sy + 0.075
    for k, name in enumerate(stages):
        bx = sx + 0.012 + k * (bw + 0.008)
        box(ax, bx, by, bw, bh, "#ffffff", radius=0.006)
        ax.text(bx + bw / 2, by + bh / 2, name, fontsize=7.2, ha="center", va="center",
                family="monospace")
        if k:
            arrow(ax, (bx - 0.008, by + bh / 2), (bx, by + bh / 2), lw=0.8)
    ax.text(sx + sw / 2, sy + 0.035, "slots · bitmaps · shadow sets · counters", fontsize=7.4,
            ha="center", color="#555555")
    # hosts around it
    hosts = [(0.49, 0.74), (0.80, 0.74), (0.49, 0.22), (0.80, 0.22)]
    for k, (hx, hy) in enumerate(hosts):
        box(ax, hx, hy, 0.15, 0.10, "#d5ecd4")
        ax.text(hx + 0.075, hy + 0.068, f"host tbh{k + 1}", fontsize=9.5, weight="bold",
                ha="center")
        ax.text(hx + 0.075, hy + 0.03, f"rank {k}: a collectives\nworker process", fontsize=7.2,
                ha="center", va="center", linespacing=1.2)
        top = hy > sy
        a = (hx + 0.075, hy if top else hy + 0.10)
        b = (sx + (0.06 if hx < sx else sw - 0.06), sy + sh if top else sy)
        arrow(ax, a, b, style="<|-|>", color="#2d6a2d", lw=1.4)
    ax.text(0.72, 0.79, "veth links, HTB-shaped\n(loss, delay: impair stage)",
            fontsize=7.4, ha="center", color="#2d6a2d", linespacing=1.2)
    # control plane and observation
    box(ax, 0.895, 0.445, 0.095, 0.19, "#fbe3c8")
    ax.text(0.9425, 0.54, "control\nchannel\n(jobs, slots,\ncounters,\ntrace)", fontsize=7.4,
            ha="center", va="center", linespacing=1.2)
    arrow(ax, (0.895, 0.54), (sx + sw, 0.54), style="<|-|>", lw=1.0, color="#8a5a14")
    ax.text(0.735, 0.125, "tcpdump → pcap → scapy / Wireshark (testbed wireshark)",
            fontsize=7.6, ha="center", color="#555555")
    ax.text(0.735, 0.06, "results: rows with time, model, fidelity, correct, cpu_bound,\n"
            "data-path counters; metadata; plots", fontsize=7.6, ha="center", color="#555555",
            linespacing=1.2)


def main(out: Path = OUT) -> Path:
    """Draw the diagram and write it to ``out`` (SVG, or PNG by suffix)."""
    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "testbed",
                         "font.family": "DejaVu Sans"})
    fig = plt.figure(figsize=(12, 5.6))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    layers(ax)
    network(ax)
    fig.savefig(out, metadata={"Date": None} if out.suffix == ".svg" else None)
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
