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


def test_cli_wiring():
    """`testbed bench datapath --help` reaches our main without importing Mininet/numba."""
    out = subprocess.run([sys.executable, "-m", "testbed.cli", "bench", "datapath", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--json" in out.stdout
