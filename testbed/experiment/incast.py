"""Incast with trimmable gradients: n senders push their gradient to one receiver.

This is the traffic of the trimming experiments (HotNets'24 "JIT gradient compression by
packet trimming"): every sender encodes its float32 gradient in the trimming layout
(``testbed.kernels.trimming``: a coarse unbiased head at the front of each payload, the exact
values behind it), puts each chunk in a testbed packet (``Codec.TRIM_LAYOUT``, ``head_bytes``
set) and sends them all at once to the receiver through one switch port. A switch whose
``trim`` stage is in ``trim`` mode cuts packets to their heads above its queue threshold; in
``drop_tail`` mode it drops them. The receiver decodes every packet (trimmed ones to the coarse
estimate), sums the senders' gradients and, after ``idle_ms`` without traffic, asks senders
for the chunks it misses (NACK) until it has them all - so drops cost time and trims cost
accuracy.

Run as an experiment job with ``op = "incast"`` (algo is ignored): rank 0 is the receiver,
every other host a sender. The row reports ``time_s`` (first packet to last chunk at the
receiver),
``model_s`` (all senders' untrimmed bytes through the receiver's link), ``trimmed_frac``,
``nacks``, ``resent``, ``max_abs_err`` and ``rel_err`` against the exact numpy sum, and
``correct`` (every element within the trimming layout's error bound for the trimmed chunks).

Processes: ``python -m testbed.experiment.incast receiver|sender ... testbed-node=<host>``
(the marker lets ``testbed cleanup`` find them).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

DATA_PORT = 41000  # the testbed UDP port: the data path recognises our header on it
CTL_PORT = 41001
NACK, DONE = b"NACK", b"DONE"
JOB_ID = 7


def sender_input(seed: int, rank: int, count: int) -> np.ndarray:
    """The gradient of sender ``rank`` (deterministic in ``seed``)."""
    return np.random.default_rng([seed, 1000 + rank]).standard_normal(count, dtype=np.float32)


def _chunks(count: int, bits: int) -> tuple[int, int]:
    from testbed.kernels.trimming import max_elements

    m = min(max_elements(bits, 1400 - 28), 256)
    return m, (count + m - 1) // m


def _frames(x: np.ndarray, rank: int, n: int, bits: int, seed: int) -> list[bytes]:
    from testbed.kernels.trimming import encode, head_bytes_for
    from testbed.kernels.wire import Codec, MsgType, new_headers

    m, n_chunks = _chunks(x.shape[0], bits)
    out = []
    for k in range(n_chunks):
        chunk = x[k * m:(k + 1) * m]
        h = new_headers(1)
        h["msg_type"] = int(MsgType.DATA)
        h["job_id"] = JOB_ID
        h["worker_id"] = rank
        h["slot"] = k & 0xFFFF
        h["n_workers"] = n
        h["codec"] = int(Codec.TRIM_LAYOUT)
        h["elem_count"] = chunk.shape[0]
        h["head_bytes"] = int(head_bytes_for(chunk.shape[0], bits))
        h["chunk_offset"] = k * m
        out.append(h.tobytes() + encode(chunk, bits, seed + rank, k * m).tobytes())
    return out


def _sender(args) -> int:
    x = sender_input(args.seed, args.rank, args.count)
    frames = _frames(x, args.rank, args.n, args.bits, args.seed)
    ctl = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    ctl.bind(("0.0.0.0", CTL_PORT))
    data = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    data.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    dst = (args.dst, DATA_PORT)
    time.sleep(max(0.0, args.start_at - time.time()))
    for f in frames:
        data.sendto(f, dst)
    deadline = time.time() + args.timeout
    ctl.settimeout(0.5)
    while time.time() < deadline:
        try:
            msg, _ = ctl.recvfrom(65536)
        except TimeoutError:
            continue
        if msg.startswith(DONE):
            return 0
        if msg.startswith(NACK):
            for k in np.frombuffer(msg[4:], dtype="<u4"):
                data.sendto(frames[int(k)], dst)
    return 3


def _receiver(args) -> int:
    from testbed.kernels.trimming import decode
    from testbed.kernels.wire import HEADER_DTYPE, HEADER_LEN, MAGIC, Flags

    senders = [s.split("=") for s in args.senders.split(",")]  # rank=ip
    ranks = {int(r): ip for r, ip in senders}
    m, n_chunks = _chunks(args.count, args.bits)
    missing = {r: set(range(n_chunks)) for r in ranks}
    total = np.zeros(args.count, np.float64)
    bound = np.zeros(args.count, np.float64)
    levels = (1 << args.bits) - 1
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind(("0.0.0.0", DATA_PORT))
    ctl = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    got = trimmed = dups = nacks = resent = 0
    t_first = t_last = None
    deadline = args.start_at + args.timeout
    idle = args.idle_ms / 1000.0
    sock.settimeout(idle)
    remaining = len(ranks) * n_chunks
    while remaining and time.time() < deadline:
        try:
            buf = sock.recv(4096)
        except TimeoutError:
            if t_first is None:
                continue  # senders have not started yet (they may start late under load)
            for r, miss in missing.items():
                if miss:
                    idx = np.fromiter(sorted(miss), dtype="<u4")
                    for i in range(0, len(idx), 300):
                        ctl.sendto(NACK + idx[i:i + 300].tobytes(), (ranks[r], CTL_PORT))
                    resent += len(idx)
            nacks += 1
            continue
        if len(buf) < HEADER_LEN:
            continue
        if t_first is None:
            t_first = time.time()
        h = np.frombuffer(buf[:HEADER_LEN], dtype=HEADER_DTYPE)[0]
        r, off, cnt = int(h["worker_id"]), int(h["chunk_offset"]), int(h["elem_count"])
        if int(h["magic"]) != MAGIC or int(h["job_id"]) != JOB_ID or r not in missing:
            continue
        k = off // m
        if k not in missing[r]:
            dups += 1
            continue
        values, full = decode(np.frombuffer(buf[HEADER_LEN:], dtype=np.uint8), cnt)
        total[off:off + cnt] += values
        if not full or int(h["flags"]) & Flags.TRIMMED:
            trimmed += 1
            scale = float(np.frombuffer(buf[HEADER_LEN:HEADER_LEN + 4], dtype="<f4")[0])
            bound[off:off + cnt] += 2.0 * scale / levels  # one quantisation step
        missing[r].discard(k)
        got += 1
        remaining -= 1
        t_last = time.time()
    for ip in ranks.values():
        for _ in range(3):  # best effort: a lost DONE only makes a sender wait for its timeout
            ctl.sendto(DONE, (ip, CTL_PORT))
    exact = np.zeros(args.count, np.float64)
    for r in ranks:
        exact += sender_input(args.seed, r, args.count)
    err = np.abs(total - exact)
    tol = bound + 1e-6 * (np.abs(exact) + 1.0)  # float32 decode rounding
    result = {"complete": remaining == 0, "received": got, "expected": len(ranks) * n_chunks,
              "trimmed": trimmed, "duplicates": dups, "nacks": nacks, "resent": resent,
              "time_s": (t_last - t_first) if t_last else None,
              "max_abs_err": float(err.max()),
              "rel_err": float(np.linalg.norm(total - exact) / np.linalg.norm(exact)),
              "within_bound": bool((err <= tol).all()), "chunk_elems": m, "chunks": n_chunks}
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0 if remaining == 0 else 4


def run_incast(net, nbytes: int, bits: int = 1, seed: int = 0, timeout_s: float = 60.0,
               idle_ms: float = 30.0, bottleneck_mbps: float | None = None) -> dict[str, Any]:
    """Run one incast on ``net`` (rank 0 receives, the other hosts send); return a row.

    ``bottleneck_mbps``: rate of the receiver's port for the model (default: the topology's
    receiver link).
    """
    from testbed.kernels.trimming import total_bytes_for
    from testbed.kernels.wire import PAYLOAD_OFFSET

    if not isinstance(bits, int) or bits not in (1, 2, 4, 8):
        raise ValueError(f"bits={bits!r}: head bits per element must be 1, 2, 4 or 8")
    hosts = list(net.hosts)
    if len(hosts) < 2:
        raise ValueError("incast needs at least 2 hosts (one receiver, one sender)")
    if nbytes < 4 or nbytes % 4:
        raise ValueError(f"nbytes={nbytes}: must be a positive multiple of 4 (float32)")
    count = nbytes // 4
    recv, senders = hosts[0], hosts[1:]
    start_at = time.time() + 2.0 + 0.15 * len(senders)  # room for the processes to start
    common = ["--count", str(count), "--bits", str(bits), "--seed", str(seed),
              "--start-at", repr(start_at), "--timeout", str(timeout_s)]
    fd, out = tempfile.mkstemp(prefix="tb-incast-", suffix=".json")
    os.close(fd)
    py = [sys.executable, "-m", "testbed.experiment.incast"]
    procs = []
    try:
        procs.append(recv.popen(py + ["receiver", *common, "--idle-ms", str(idle_ms),
                                      "--out", out, "--senders",
                                      ",".join(f"{r + 1}={h.IP()}"
                                               for r, h in enumerate(senders)),
                                      f"testbed-node={recv.name}"]))
        for r, h in enumerate(senders):
            procs.append(h.popen(py + ["sender", *common, "--rank", str(r + 1), "--n",
                                       str(len(senders)), "--dst", recv.IP(),
                                       f"testbed-node={h.name}"]))
        rc = procs[0].wait(timeout=timeout_s + (start_at - time.time()) + 30)
        with open(out) as f:
            res = json.load(f)
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        logs = b""
        if procs and procs[0].poll() is not None and procs[0].stdout is not None:
            logs = procs[0].stdout.read()[-1500:]
        raise RuntimeError(f"incast receiver failed ({type(e).__name__}: {e}) "
                           f"{logs.decode(errors='replace')}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        os.unlink(out)
    if rc != 0 or not res["complete"]:
        raise RuntimeError(f"incast incomplete after {timeout_s} s: received {res['received']}"
                           f" of {res['expected']} chunks")
    m = res["chunk_elems"]
    frame = PAYLOAD_OFFSET + int(total_bytes_for(m, bits))
    if bottleneck_mbps is None:
        bottleneck_mbps = _receiver_mbps(net)
    model_s = len(senders) * res["chunks"] * frame * 8 / (bottleneck_mbps * 1e6)
    n = len(senders)
    return {"op": "incast", "algo": f"trim{bits}", "n": n, "bytes": nbytes, "count": count,
            "time_s": res["time_s"], "algbw": nbytes * n * 8 / res["time_s"] / 1e9,
            "busbw": nbytes * n * 8 / res["time_s"] / 1e9, "model_s": model_s,
            "fidelity": res["time_s"] / model_s, "cpu_bound": False,
            "max_abs_err": res["max_abs_err"], "rel_err": res["rel_err"],
            "correct": res["within_bound"], "trimmed_frac": res["trimmed"] / res["expected"],
            "nacks": res["nacks"], "resent": res["resent"], "duplicates": res["duplicates"],
            "seed": seed, "rep": 0}


def _receiver_mbps(net) -> float:
    topo = getattr(net, "topo", None)
    for s in getattr(topo, "link_specs", []):
        if "tbh1" in (s.a, s.b) and s.bw_mbps:
            return float(s.bw_mbps)
    return 100.0


def main(argv: list[str] | None = None) -> int:
    """Process entry: ``receiver`` or ``sender`` (started by :func:`run_incast`)."""
    p = argparse.ArgumentParser(prog="python -m testbed.experiment.incast")
    p.add_argument("role", choices=("receiver", "sender"))
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--bits", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-at", type=float, required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--idle-ms", type=float, default=30.0)
    p.add_argument("--out")
    p.add_argument("--senders")
    p.add_argument("--rank", type=int)
    p.add_argument("--n", type=int)
    p.add_argument("--dst")
    args, _markers = p.parse_known_args(argv)  # testbed-node=<host> markers are ignored
    return _receiver(args) if args.role == "receiver" else _sender(args)


if __name__ == "__main__":
    raise SystemExit(main())
