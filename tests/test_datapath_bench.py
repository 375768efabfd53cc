"""The data-path benchmark runs end to end and its load tools count exactly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from testbed.datapath.bench import build_ring, load_frames, save_frames
from testbed.kernels.wire import HEADER_OFFSET, MsgType


def test_rings_and_frame_files(tmp_path):
    """Generator rings: distinct UDP frames to port 9; agg rings in protocol order."""
    udp = build_ring("udp", "02:00:00:00:00:01", "02:00:00:00:00:02", "10.0.0.1", "10.0.0.2",
                     16, 50)
    assert len(set(udp)) == 50 and all(f[36:38] == b"\x00\x09" for f in udp)
    agg = build_ring("agg", "02:00:00:00:00:01", "02:54:42:00:00:fe", "10.0.0.1",
                     "10.0.0.254", 16, 0)
    assert all(f[HEADER_OFFSET + 3] == MsgType.DATA for f in agg)
    slots = [(f[HEADER_OFFSET + 8], f[HEADER_OFFSET + 10]) for f in agg]
    assert slots[:4] == [(0, 0), (0, 0), (1, 0), (1, 0)]
    save_frames(str(tmp_path / "f.npz"), udp)
    assert load_frames(str(tmp_path / "f.npz")) == udp
    with pytest.raises(ValueError, match="mode"):
        build_ring("nope", "02:00:00:00:00:01", "02:00:00:00:00:02", "10.0.0.1", "10.0.0.2",
                   16, 1)


def check_bench_rows(rows: list[dict], notes: dict) -> None:
    """A quick run of the real benchmark (its ``--quick`` options; run by ``testbed bench all
    --quick`` in test_readme_commands): every program row has every anchor measured in the same
    run, positive rates, and ratio == kpps / anchor_kpps."""
    programs = {r["program"] for r in rows}
    assert programs == {"forward", "aggregate"}
    anchors = {r["anchor"] for r in rows}
    assert {"linux-bridge", "python-naive", "engine-mmsg"} <= anchors
    assert "ovs-userspace" in anchors or "skipped" in str(notes.get("ovs-userspace"))
    for r in rows:
        assert set(r) == {"program", "packet_bytes", "kpps", "gbps", "anchor", "anchor_kpps",
                          "ratio"}
        assert r["packet_bytes"] == HEADER_OFFSET + 28 + 64
        assert r["kpps"] > 0 and r["anchor_kpps"] > 0
        assert r["ratio"] == pytest.approx(r["kpps"] / r["anchor_kpps"], rel=0.01)
    size = HEADER_OFFSET + 28 + 64
    for v in ("forward", "engine-mmsg"):  # what the generator offered, what the engine cost
        n = notes[f"{v}/{size}B"]
        assert n["offered_kpps"] > 0 and n["engine_us_per_pkt"] > 0 and n["gen_us_per_pkt"] > 0
    # aggregate: the rate is a trial that lost nothing (every contribution came back)
    agg = notes[f"aggregate/{size}B"]["trials"]
    best = max((t for t in agg if t["ok"]), key=lambda t: t["sent_kpps"])
    assert best["results"] >= best["contributions"] > 0
    assert next(r["kpps"] for r in rows if r["program"] == "aggregate") == best["sent_kpps"]


def test_cli_wiring():
    """`testbed bench datapath --help` reaches our main without importing Mininet/numba."""
    out = subprocess.run([sys.executable, "-m", "testbed.cli", "bench", "datapath", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--json" in out.stdout
