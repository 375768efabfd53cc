"""The Wireshark dissector is generated from the wire table and reads what scapy reads, field
for field, in a pcap captured from a real INA run."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time

import pytest

from testbed.kernels.wire import FIELD_ENUMS, HEADER_FIELDS
from testbed.wireshark import lua_dissector


def test_dissector_covers_every_field_and_is_deterministic():
    lua = lua_dissector()
    assert lua == lua_dissector()
    for f in HEADER_FIELDS:
        assert f'"testbed.{f.name}"' in lua, f.name
    for name, enum_cls in FIELD_ENUMS.items():
        for m in enum_cls:
            if m.name and (m.value & (m.value - 1) == 0 or name != "flags"):
                assert f'"{m.name}"' in lua, (name, m.name)
    assert 'DissectorTable.get("udp.port"):add(41000, p)' in lua


@pytest.mark.mininet
@pytest.mark.skipif(shutil.which("tshark") is None or shutil.which("tcpdump") is None,
                    reason="tshark/tcpdump not installed (make setup installs them)")
def test_tshark_reads_an_ina_capture_like_scapy(tmp_path):
    from scapy.layers.inet import UDP
    from scapy.utils import rdpcap

    from testbed.collectives.spec import CollectiveSpec
    from testbed.collectives.testing import run_direct
    from testbed.datapath.scapy_layer import TestbedHeader
    from testbed.topologies import Star, TestbedNet

    pcap = tmp_path / "ina.pcap"
    with TestbedNet(Star(2, bw_mbps=None, switch="programmable")) as net:
        h1 = net.hosts[0]
        # -Z root: tcpdump would otherwise write as user tcpdump, into a root-only folder
        cap = h1.popen(["tcpdump", "-Z", "root", "--immediate-mode", "-i", h1.defaultIntf().name,
                        "-U", "-w",
                        str(pcap), "udp port 41000"], stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE)
        try:
            line = cap.stderr.readline().decode()  # "listening on ...": capturing from now
            assert "listening" in line, line
            run_direct(net, CollectiveSpec(algo="ina", nbytes=4 * 2000, window=4, timeout_s=20),
                       2)
            time.sleep(0.3)
        finally:
            cap.send_signal(signal.SIGINT)
            err = cap.communicate(timeout=10)[1].decode(errors="replace")
    assert pcap.exists() and "0 packets captured" not in err, err
    lua = tmp_path / "testbed.lua"
    lua.write_text(lua_dissector())
    names = [f.name for f in HEADER_FIELDS]
    out = subprocess.run(["tshark", "-X", f"lua_script:{lua}", "-r", str(pcap), "-T", "fields",
                          "-E", "separator=|", "-Y", "testbed"]
                         + [a for n in names for a in ("-e", f"testbed.{n}")],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rows = [line.split("|") for line in out.splitlines() if line]
    packets = [p for p in rdpcap(str(pcap)) if UDP in p and TestbedHeader in p]
    assert len(rows) == len(packets) > 10
    kinds = set()
    for row, p in zip(rows, packets, strict=True):
        h = p[TestbedHeader]
        for name, text in zip(names, row, strict=True):
            want = getattr(h, name)
            if name == "scale":
                assert abs(float(text) - float(want)) <= 1e-6 * max(1.0, abs(float(want)))
            else:
                assert int(text, 0) == int(want), (name, text, want)
        kinds.add(int(h.msg_type))
    assert kinds >= {0, 1}  # DATA out, RESULT back
