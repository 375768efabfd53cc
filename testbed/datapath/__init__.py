"""Userspace programmable data path: an emulated Tofino-class switch / BlueField-class SmartNIC.

One engine process per Mininet node serves all the node's ports in batches (``recvmmsg`` /
``sendmmsg`` into numpy buffers, one Numba call per stage per burst) and runs a pipeline of
:class:`~testbed.datapath.batch.Stage` programs configured by name.

Modules (import what you need; nothing heavy is imported here):

* ``batch`` - the Batch/Stage contract; ``engine`` - the process (``STAGES`` registry,
  ``python -m testbed.datapath.engine``); ``io`` - batched AF_PACKET ports;
* programs: ``forward`` (L2/ECMP/learning, L3 /32; ``wire``), ``aggregate`` (SwitchML
  protocol), ``trim``, ``impair``, ``codec`` (``nic_codec``);
* ``control`` - JSON-lines control socket and :class:`~testbed.datapath.control.DatapathClient`;
* ``nodes`` - ``ProgrammableSwitch``, ``SmartNIC``, ``programmable_star``;
* ``aggclient`` - a minimal SwitchML worker on a UDP socket; ``scapy_layer`` - the scapy header;
* ``bench`` - ``testbed bench datapath`` and its load tools.
"""
