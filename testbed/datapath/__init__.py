"""Userspace programmable data path: an emulated Tofino-class switch / BlueField-class SmartNIC.

One engine process per Mininet node serves all the node's ports in batches (``recvmmsg`` /
``sendmmsg`` into numpy buffers, one Numba call per stage per burst) and runs a pipeline of
:class:`~testbed.datapath.batch.Stage` programs configured by name.

Modules (import what you need; nothing heavy is imported here):

* ``batch`` - the Batch/Stage contract; ``programs`` - the ``STAGES`` registry of program
  names and program-list checks (no Numba); ``engine`` - the process
  (``python -m testbed.datapath.engine``); ``io`` - batched AF_PACKET ports;
* stages: ``forward`` (L2/ECMP/learning, L3 /32; ``wire``), ``aggregate`` (SwitchML
  protocol), ``trim``, ``impair`` (``impair``, ``impair_ingress``), ``codec`` (``nic_codec``);
* ``control`` - JSON-lines control socket and :class:`~testbed.datapath.control.DatapathClient`;
* ``nodes`` - the Mininet node classes ``ProgrammableSwitch`` and ``SmartNIC``;
* ``aggclient`` - a minimal SwitchML worker on a UDP socket; ``scapy_layer`` - the scapy header;
* ``bench`` - the load tools of the data-path benchmark and tests (frame rings, a batched
  generator and sink, a per-packet Python forwarder), run inside hosts.
"""
