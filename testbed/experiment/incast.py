"""Incast with trimmable gradients: n senders push their gradient to one receiver.

This is the traffic of the trimming experiments (HotNets'24 "JIT gradient compression by
packet trimming"): every sender encodes its float32 gradient in the trimming layout
(``testbed.kernels.trimming``: a coarse unbiased head at the front of each payload, the exact
values behind it), puts each chunk in a testbed packet (``Codec.TRIM_LAYOUT``, ``head_bytes``
set; the frames of the training jobs' trimmed gather, ``testbed.collectives.trimmed``) and
sends them all at once to the receiver through one switch port. A switch whose
``trim`` stage is in ``trim`` mode cuts packets to their heads above its queue threshold; in
``drop_tail`` mode it drops them. The receiver decodes every packet (trimmed ones to the coarse
estimate), sums the senders' gradients and, after ``idle_ms`` without traffic, asks senders
for the chunks it misses (NACK) until it has them all - so drops cost time and trims cost
accuracy.

Run as an experiment job with ``op = "incast"`` (algo is ignored): rank 0 is the receiver,
every other host a sender. The row is a report row like every collective's (see
:func:`run_incast`): ``time_s`` (first packet to last chunk at the receiver), ``model_s`` (all
senders' untrimmed bytes through the receiver's bottleneck), ``cpu_bound``, ``max_abs_err``
against the exact numpy sum and ``correct`` (every element within the trimming layout's error
bound for the trimmed chunks), plus ``rel_err``, ``trimmed_frac``, ``nacks`` and ``resent``.

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

from testbed.collectives.report import Measured, make_row
from testbed.collectives.trimmed import (
    BITS,
    DATA_PORT,
    DONE,
    NACK,
    NACK_MAX,
    TRIMMABLE_TOS,
    chunk_elements,
    encode_frames,
    frame_sizes,
)
from testbed.kernels.trimming import decode
from testbed.kernels.wire import HEADER_DTYPE, HEADER_LEN, MAGIC, Flags

#: Senders listen for NACK/DONE here (the training jobs' gather uses its own ports).
CTL_PORT = 41001
BLIND_NACK_S = 1.0  # before the first frame arrives: grace, then re-ask this often
JOB_ID = 7


def sender_input(seed: int, rank: int, count: int) -> np.ndarray:
    """The gradient of sender ``rank`` (deterministic in ``seed``)."""
    return np.random.default_rng([seed, 1000 + rank]).standard_normal(count, dtype=np.float32)


def _sender(args) -> int:
    x = sender_input(args.seed, args.rank, args.count)
    frames = encode_frames(x, args.rank, args.n, args.bits, args.seed, JOB_ID, step=0)
    ctl = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    ctl.bind(("0.0.0.0", CTL_PORT))
    data = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    data.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    data.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, TRIMMABLE_TOS)  # a UET switch cuts it
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
    # Bind first: the senders start at ``start_at`` whether or not this process is ready
    # (a cold Numba cache can take longer than the head start under load).
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind(("0.0.0.0", DATA_PORT))
    senders = [s.split("=") for s in args.senders.split(",")]  # rank=ip
    ranks = {int(r): ip for r, ip in senders}
    m, n_chunks = chunk_elements(args.bits), frame_sizes(args.count, args.bits)[0]
    missing = {r: set(range(n_chunks)) for r in ranks}
    total = np.zeros(args.count, np.float64)
    bound = np.zeros(args.count, np.float64)
    levels = (1 << args.bits) - 1
    ctl = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    got = trimmed = dups = nacks = resent = 0
    t_first = t_last = None
    deadline = args.start_at + args.timeout
    idle = args.idle_ms / 1000.0
    sock.settimeout(idle)
    remaining = len(ranks) * n_chunks
    next_blind_nack = 0.0
    while remaining and time.time() < deadline:
        try:
            buf = sock.recv(4096)
        except TimeoutError:
            if t_first is None:
                # Nothing yet: the senders may start late under load, or everything they sent
                # before this socket existed is gone. After a grace period ask for it all
                # again, at most every BLIND_NACK_S (a sender resends only what is named).
                now = time.time()
                if now < args.start_at + BLIND_NACK_S or now < next_blind_nack:
                    continue
                next_blind_nack = now + BLIND_NACK_S
            for r, miss in missing.items():
                if miss:
                    idx = np.fromiter(sorted(miss), dtype="<u4")
                    for i in range(0, len(idx), NACK_MAX):
                        ctl.sendto(NACK + idx[i:i + NACK_MAX].tobytes(), (ranks[r], CTL_PORT))
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
               idle_ms: float = 30.0) -> dict[str, Any]:
    """Run one incast on ``net`` (rank 0 receives, the other hosts send); return a report row.

    The row is :func:`testbed.collectives.report.make_row`'s (``op='incast'``,
    ``algo='trim<bits>'``, ``n`` senders, ``bytes`` per sender; ``busbw`` is what crossed the
    receiver's link per second) plus ``rel_err``, ``trimmed_frac``, ``nacks``, ``resent`` and
    ``duplicates``. ``model_s``: every sender's untrimmed frames through the receiver's
    bottleneck (:func:`receiver_rate_bps`, also the row's ``bw_mbps``). ``cpu_bound``: the
    senders, the receiver or a data-path engine saturated a CPU or waited for one, by the
    collectives' measurement and thresholds.
    """
    if not isinstance(bits, int) or bits not in BITS:
        raise ValueError(f"bits={bits!r}: head bits per element must be one of {BITS}")
    hosts = list(net.hosts)
    if len(hosts) < 2:
        raise ValueError("incast needs at least 2 hosts (one receiver, one sender)")
    if nbytes < 4 or nbytes % 4:
        raise ValueError(f"nbytes={nbytes}: must be a positive multiple of 4 (float32)")
    rate_bps = receiver_rate_bps(net)
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
        cpu = wait_sampling(procs, net.engine_pids(), start_at,
                             timeout_s + (start_at - time.time()) + 30)
        rc = procs[0].returncode
        with open(out) as f:
            res = json.load(f)
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        logs = b""
        if procs and procs[0].poll() is not None and procs[0].stdout is not None:
            logs = procs[0].stdout.read()[-1500:]
        raise RuntimeError(f"incast receiver failed ({type(e).__name__}: {e}) "
                           f"{logs.decode(errors='replace')}") from None
    finally:
        stop_processes(procs)
        os.unlink(out)
    if rc != 0 or not res["complete"]:
        raise RuntimeError(f"incast incomplete after {timeout_s} s: received {res['received']}"
                           f" of {res['expected']} chunks")
    packets, frame, _ = frame_sizes(count, bits)
    n = len(senders)
    model_s = n * packets * frame * 8 / rate_bps
    row = make_row(Measured(op="incast", algo=f"trim{bits}", nbytes=nbytes, count=count,
                            seed=seed),
                   n=n, time_s=res["time_s"], model_s=model_s, cpu_bound=cpu["bound"],
                   max_abs_err=res["max_abs_err"], correct=res["within_bound"], rep=0,
                   topology=net.topo.kind, bw_mbps=rate_bps / 1e6,
                   cpu_max=cpu["cpu_max"], cpu_engine=cpu["cpu_engine"],
                   cpu_wait=cpu["cpu_wait"], cpu_s=cpu["cpu_s"],
                   engine_cpu_s=cpu["engine_cpu_s"], cpu_util=cpu["cpu_util"],
                   setup_s=float("nan"), mem_mb=float("nan"))
    row.update(rel_err=res["rel_err"], trimmed_frac=res["trimmed"] / res["expected"],
               nacks=res["nacks"], resent=res["resent"], duplicates=res["duplicates"])
    return row


def stop_processes(procs: list) -> None:
    """End the incast's processes that still run: SIGTERM, then SIGKILL after 5 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def receiver_rate_bps(net) -> float:
    """Rate (bit/s) at which the senders' packets can reach the receiver (rank 0).

    The network's per-flow bottleneck with every sender sending to the receiver at once, times
    the number of senders: the receiver's link, or a slower link on the way. A ``trim`` stage
    that drains the receiver's switch port slower than that (``rate_mbps``) is the bottleneck
    instead. Raises ``ValueError`` when the links are unshaped (no rate to model).
    """
    hosts = net.topo.host_names
    flow = net.bottleneck_bps(hosts, pattern="all_to_one")
    if flow is None:
        raise ValueError("incast: the links to the receiver are unshaped (bw_mbps=None), so "
                         "there is no link rate for the model; give the topology a bw_mbps")
    rate = flow * (len(hosts) - 1)
    plan = net.programs_plan()
    for s in net.topo.link_specs:
        if hosts[0] not in (s.a, s.b):
            continue
        node, port = (s.b, s.port_b) if s.a == hosts[0] else (s.a, s.port_a)
        for program, settings in plan.get(node, []):
            drain = settings.get("rate_mbps") if program == "trim" else None
            if isinstance(drain, dict):
                drain = drain.get(f"{node}-eth{port}")
            if drain:
                rate = min(rate, float(drain) * 1e6)
    return rate


def wait_sampling(procs: list, engines: list[int], start_at: float, timeout_s: float
                   ) -> dict[str, Any]:
    """Wait for the receiver (``procs[0]``) to exit, measuring the CPU of every incast thread
    and data-path engine (per thread and core, ``testbed.collectives.cpumon``) from
    ``start_at`` (wall clock) on; return the CPU figures and ``bound``."""
    # The senders and the receiver run this module too: the CPU measurement is imported only
    # here, where it is used, so that those processes start fast.
    from testbed.collectives.cpumon import CpuMonitor  # noqa: PLC0415

    deadline = time.monotonic() + timeout_s
    groups = {"ranks": [p.pid for p in procs], "engines": engines}
    mon = None
    while procs[0].poll() is None:
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired("incast receiver", timeout_s)
        if mon is None and time.time() >= start_at:
            mon = CpuMonitor(groups)
        elif mon is not None:
            mon.sample()
        time.sleep(0.05)
    if mon is None:  # the receiver ended before the start time: nothing ran
        mon = CpuMonitor(groups)
    cpu = mon.stop()
    return {"cpu_max": round(cpu.group_max["ranks"], 3),
            "cpu_engine": round(cpu.group_max["engines"], 3),
            "cpu_wait": round(cpu.cpu_wait, 3), "cpu_util": round(cpu.cpu_util, 3),
            "cpu_s": round(cpu.group_cpu_s["ranks"], 3),
            "engine_cpu_s": round(cpu.group_cpu_s["engines"], 3), "bound": cpu.cpu_bound,
            "why": "; ".join(cpu.why) if isinstance(cpu.why, list) else str(cpu.why or "")}


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
