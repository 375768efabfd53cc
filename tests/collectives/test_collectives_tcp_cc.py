"""The collectives' TCP connections run the congestion control the spec names (not the host's
default, which differs between machines), rows record it, and a name the kernel does not have
is a clear error."""

from __future__ import annotations

import re
import socket
import subprocess

import numpy as np
import pytest

from testbed import doctor
from testbed.bench import fidelity, run_benchmark
from testbed.collectives import CollectiveSpec
from testbed.collectives.model import RS_WINDOW_BYTES, tcp_window_clamp
from testbed.collectives.report import make_row
from testbed.collectives.testing import connected_mesh
from testbed.collectives.transport import (
    DEFAULT_TCP_CC,
    CollectiveError,
    host_tcp_cc,
    set_tcp_cc,
    wait_all,
)

AVAILABLE = open("/proc/sys/net/ipv4/tcp_available_congestion_control").read().split()


def _cc(s: socket.socket) -> str:
    return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()


def _mesh_ccs(tcp_cc, job: int) -> set[str]:
    comms = connected_mesh(job, ["127.0.7.1"] * 3, tcp_cc=tcp_cc)
    try:
        # every connection on both ends: the connecting rank's and the accepted socket
        return {_cc(s) for c in comms for s in c.socks.values()}
    finally:
        for c in comms:
            c.close()


@pytest.mark.skipif(DEFAULT_TCP_CC not in AVAILABLE,
                    reason=f"this kernel has no {DEFAULT_TCP_CC} congestion control")
def test_connections_run_the_default_not_the_hosts():
    assert _mesh_ccs(DEFAULT_TCP_CC, 71) == {DEFAULT_TCP_CC}
    assert CollectiveSpec().tcp_cc == DEFAULT_TCP_CC


def test_a_named_algorithm_on_every_connection_and_none_keeps_the_hosts():
    other = next((c for c in ("reno", "bbr", "cubic") if c in AVAILABLE and c != host_tcp_cc()),
                 None)
    if other is None:
        pytest.skip(f"no algorithm besides the host's default ({host_tcp_cc()}): {AVAILABLE}")
    assert _mesh_ccs(other, 72) == {other}
    assert _mesh_ccs(None, 73) == {host_tcp_cc()}


def _rcv_wscales(comms) -> list[int]:
    """The receive window scale of every connection of ``comms`` (``ss -ti``: wscale:snd,rcv)."""
    ports = {s.getsockname()[1] for c in comms for s in c.socks.values()}
    out = subprocess.run(["ss", "-tinH", "src", "127.0.7.1"], capture_output=True, text=True,
                         check=True).stdout
    lines = out.splitlines()
    got = []
    for i, line in enumerate(lines):
        m = re.search(r"127\.0\.7\.1:(\d+)\s", line)
        if m and int(m.group(1)) in ports:
            got += [int(w) for w in re.findall(r"wscale:\d+,(\d+)", " ".join(lines[i:i + 2]))]
    return got


def test_hd_and_ring_clamp_their_window_on_both_ends_and_still_move_large_messages():
    # hd, and the ring with twice as much; faster links get more; rs bounds itself
    assert tcp_window_clamp("hd") == tcp_window_clamp("hd", 100e6) == RS_WINDOW_BYTES
    assert tcp_window_clamp("hd", 1e9) == int(1e9 / 8 * 0.01)
    assert tcp_window_clamp("ring", 100e6) == 2 * RS_WINDOW_BYTES
    assert tcp_window_clamp("rs") is None and tcp_window_clamp("ina") is None
    clamp = tcp_window_clamp("hd")
    comms = connected_mesh(75, ["127.0.7.1"] * 2, window_clamp=clamp)
    try:
        # what bounds the window for good: the scale both ends chose from the clamp at the
        # handshake (autotuning later raises the clamp itself, not the scale)
        assert sorted(_rcv_wscales(comms)) == [2, 2]  # 65535 << 2 >= 128 KiB
        x = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: 16 of the largest windows
        out = np.zeros_like(x)
        fut = comms[0].send(1, x)
        comms[1].recv(0, out)
        wait_all([fut])
        assert np.array_equal(out, x)
    finally:
        for c in comms:
            c.close()
    plain = connected_mesh(76, ["127.0.7.1"] * 2)  # None: the kernel's own window
    try:
        assert all(w > 2 for w in _rcv_wscales(plain)) and len(_rcv_wscales(plain)) == 2
    finally:
        for c in plain:
            c.close()


def test_an_algorithm_the_kernel_lacks_is_a_clear_error():
    with pytest.raises(CollectiveError, match=r"no TCP congestion control 'nosuchcc'.*available"):
        connected_mesh(74, ["127.0.7.1"] * 2, tcp_cc="nosuchcc")
    s = socket.socket()
    try:
        with pytest.raises(CollectiveError, match="modprobe tcp_nosuchcc"):
            set_tcp_cc(s, "nosuchcc")
    finally:
        s.close()


@pytest.mark.parametrize("bad", ["", "Cubic", "cu bic", 3, "x" * 17])
def test_spec_rejects_what_is_not_a_name(bad):
    with pytest.raises(ValueError, match="tcp_cc"):
        CollectiveSpec(tcp_cc=bad).validate()


def test_rows_record_the_congestion_control_of_tcp_runs_only():
    def row(spec, **ina):
        return make_row(spec, n=4, time_s=1.0, model_s=1.0, cpu_bound=False, max_abs_err=0.0,
                        correct=True, rep=0, ina=ina or None)

    assert row(CollectiveSpec(algo="hd", tcp_cc="reno"))["tcp_cc"] == "reno"
    assert row(CollectiveSpec(algo="ring", tcp_cc=None))["tcp_cc"] == host_tcp_cc()
    assert row(CollectiveSpec(algo="ina"))["tcp_cc"] is None
    # an INA job a switch refused runs as ring on the hosts, over TCP
    assert row(CollectiveSpec(algo="ina"), placement_mode="refused")["tcp_cc"] == DEFAULT_TCP_CC


def test_doctor_says_whether_the_default_is_in_this_kernel():
    c = doctor._check_tcp_cc()
    assert c["status"] == ("ok" if DEFAULT_TCP_CC in AVAILABLE else "degraded"), c
    assert host_tcp_cc() in c["detail"] and DEFAULT_TCP_CC in c["detail"]


def test_fidelity_bench_refuses_a_bad_network_or_algorithm_before_building_anything():
    with pytest.raises(ValueError, match=r"unknown network\(s\) \['star9'\]"):
        fidelity.run(quick=True, only=["star9"])
    with pytest.raises(ValueError, match="tcp_cc='Bad'"):
        fidelity.run(quick=True, tcp_cc="Bad")
    assert run_benchmark("fidelity", {"only": "star9"}, quick=True) == 2
    # a bad queue: refused the same way
    assert run_benchmark("fidelity", {"queue_ms": -5.0}, quick=True) == 2


def test_fidelity_bench_runs_tcp_algorithms_once_per_congestion_control():
    ccs = [{"tcp_cc": "reno"}, {"tcp_cc": "cubic"}]
    runs = fidelity._runs([4], ccs)
    assert [(a, cc.get("tcp_cc")) for _s, a, cc in runs] == [
        ("ring", "reno"), ("ring", "cubic"), ("hd", "reno"), ("hd", "cubic"),
        ("rs", "reno"), ("rs", "cubic"), ("ina", "reno")]  # INA has no TCP: once

    def row(algo, t, m, cc):
        return {"topology": "t", "algo": algo, "bytes": 4 << 20, "time_s": t, "model_s": m,
                "fidelity": t / m, "cpu_bound": False, "correct": True, "tcp_cc": cc}

    # with reno the ring beats INA as the model says; with cubic it does not
    rows = [row("ring", 1.0, 1.0, "reno"), row("ring", 1.6, 1.0, "cubic"),
            row("ina", 1.5, 1.5, None)]
    lines = fidelity.summary(rows)
    assert len(lines) == 3
    assert "same order" in lines[1] and lines[1].endswith("[tcp reno]")
    assert "ORDER DIFFERS" in lines[2] and lines[2].endswith("[tcp cubic]")
    assert not fidelity.summary(rows[:1] + rows[2:])[1].endswith("]")  # one cc: no tag
