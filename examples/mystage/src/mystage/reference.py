"""Plain-Python twin of the msgcount kernel: same name, same inputs minus ``counts``."""

from __future__ import annotations

import numpy as np

from testbed.datapath.batch import PORT_UNSET
from testbed.kernels.reference.packets import parse_frame

from . import COLUMNS, OTHER


def count_kernel(buf, length, in_port, out_port, n: int, n_ports: int) -> np.ndarray:
    """``counts[port, column]`` of the undecided received frames among the first ``n``."""
    counts = np.zeros((n_ports, len(COLUMNS)), dtype=np.int64)
    for i in range(n):
        if in_port[i] < 0 or out_port[i] != PORT_UNSET:
            continue
        _status, h = parse_frame(buf[i], int(length[i]))
        counts[in_port[i], OTHER if h is None else int(h["msg_type"][0])] += 1
    return counts
