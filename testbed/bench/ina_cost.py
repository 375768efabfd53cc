"""``testbed bench ina-cost``: CPU time per packet of the INA kernels, without a network.

Worker: one INA worker (int32 SwitchML mode, ``W`` slots, 4 MiB) against an echo aggregator
that turns every DATA row into its RESULT; bursts of ``burst`` RESULTs go through the client's
per-burst entry point (apply, build the next packets), as ``recvmmsg`` would deliver them.
Switch: the aggregate stage of one switch summing rounds of ``n`` members (256 int32 lanes),
``burst`` frames per call, each completed round emitting its ``n`` RESULTs. Only the kernel
calls are timed (their dispatch included: on small bursts it is a large part), so the figures
are CPU time per packet whatever the machine's load does to wall time around them.

Anchor: ``np.add`` of one packet's 256 int32 lanes into a register row, per packet (the
arithmetic every contribution needs), timed alternately with the kernels. Rows carry the
median, min and max over ``reps`` runs and the CPU model.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from testbed.bench.protocol import Outcome
from testbed.collectives import ina
from testbed.collectives import inakernel as ik
from testbed.datapath.aggregate import AggregateStage
from testbed.datapath.batch import PORT_UNSET, Batch
from testbed.kernels.benchutil import cpu_description
from testbed.kernels.packed import array_table
from testbed.kernels.reference.packets import udp_frame
from testbed.kernels.wire import FIELD_OFFSETS, TESTBED_UDP_PORT, Codec, MsgType, pack_header

AGG_MAC, AGG_IP = "02:54:42:01:00:00", "10.254.0.1"
MEMBER_PORT = 20001


def worker_ns(burst: int, W: int = 128, count: int = 1 << 20) -> float:
    """Nanoseconds of worker kernel per packet (RESULT applied + next DATA built)."""
    slots, loop = ik.new_slots(W, 0), ik.new_loop(time.monotonic())
    rbuf = np.zeros((burst, ina.RB), np.uint8)
    rhdr = np.zeros((burst, 8), np.uint64)  # recvmmsg's mmsghdr rows: msg_len in column 7
    drop = np.zeros(burst, np.bool_)
    send_list = np.zeros(W, np.int64)
    x = np.random.default_rng(0).standard_normal(count).astype(np.float32)
    K = -(-count // ik.ELEMS)
    p = ik.Payload(ik.MODE_INT32, x, np.zeros_like(x), np.zeros(count, np.int32),
                   np.full(K, -126, np.int16), K, W, ik.ELEMS, count, 4, 1, 0, 0.0, 1.0, 1,
                   np.uint64(0), np.uint64(0), np.zeros(ik.THC_ELEMS, np.float32))
    arrays = ik.burst_arrays(rbuf, rhdr, np.zeros(burst, np.int64), drop, slots, p, send_list,
                             np.zeros((W, 2), np.uint64), np.zeros((W, 8), np.uint64),
                             np.zeros((W, 3), np.uint64))
    table, scalars = array_table(arrays, ik.BURST_SPEC), ik.payload_scalars(p)
    k = ik.start(slots, loop, p, time.monotonic(), send_list)
    fifo, done, spent = list(send_list[:k]), 0, 0.0
    while fifo:
        m = min(burst, len(fifo))
        for i, s in enumerate(fifo[:m]):  # the echo aggregator
            ln = slots.lens[s]
            rbuf[i, :ln] = slots.pkts[s, :ln]
            rbuf[i, FIELD_OFFSETS["msg_type"]] = MsgType.RESULT
            rhdr[i, 7] = ln
        fifo = fifo[m:]
        t = time.perf_counter()
        d, ns, _, _, _, bad, _, _ = ik.on_burst(table, loop, scalars, m, time.monotonic(),
                                             ik.SEND_GSO, ina.GSO_BURST_BYTES,
                                             ina.UDP_MAX_SEGMENTS, ina.FRAME_OVERHEAD)
        spent += time.perf_counter() - t
        if bad >= 0 or d != m:
            raise RuntimeError(f"bench ina-cost: the worker took {d} of {m} echoed RESULTs")
        done += d
        fifo.extend(send_list[:ns])
    return spent / done * 1e9


def switch_frames(n: int = 4, slots: int = 64, rounds: int = 32, lanes: int = 256):
    """(frames with their ingress ports, the job registration) for ``rounds`` rounds of every
    slot, the members' contributions interleaved as they arrive from ``n`` ports."""
    rng = np.random.default_rng(1)
    mac, ip = bytes.fromhex(AGG_MAC.replace(":", "")), bytes(int(v) for v in AGG_IP.split("."))
    frames = []
    for r in range(rounds):
        for s in range(slots):
            for m in range(n):
                hdr = pack_header(msg_type=int(MsgType.DATA), job_id=1, worker_id=m, slot=s,
                                  slot_set=r & 1, codec=int(Codec.INT32), n_workers=n,
                                  elem_count=lanes, chunk_offset=(r * slots + s) * lanes, seq=r)
                vals = rng.integers(-1000, 1000, lanes, dtype=np.int32).tobytes()
                frames.append((udp_frame(bytes([2, 0, 0, 0, 0, m + 1]), mac,
                                         bytes([10, 0, 0, m + 1]), ip, MEMBER_PORT,
                                         TESTBED_UDP_PORT, hdr + vals), m))
    job = {"slots": slots, "seq0": 0, "lanes": lanes, "members": [
        {"worker": m, "mac": f"02:00:00:00:00:{m + 1:02x}", "ip": f"10.0.0.{m + 1}",
         "port": MEMBER_PORT, "ingress": f"p{m}"} for m in range(n)]}
    return frames, job


def switch_ns(burst: int, frames: list, job: dict, n: int = 4) -> float:
    """Nanoseconds of the aggregate stage per received frame (its RESULTs included)."""
    stage = AggregateStage(ports=[f"p{i}" for i in range(n)], agg_ip=AGG_IP, agg_mac=AGG_MAC,
                           pool_slots=job["slots"], pool_bytes=0)
    stage.configure(jobs={1: job})
    b = Batch(burst * (n + 1))
    spent, results = 0.0, 0
    for i in range(0, len(frames), burst):
        chunk = frames[i:i + burst]
        b.reset()
        for j, (f, port) in enumerate(chunk):
            b.buf[j, :len(f)] = np.frombuffer(f, np.uint8)
            b.length[j], b.in_port[j], b.out_port[j] = len(f), port, PORT_UNSET
        b.n = len(chunk)
        t = time.perf_counter()
        stage.process(b, 0)
        spent += time.perf_counter() - t
        results += b.n - len(chunk)
    if results != len(frames):
        raise RuntimeError(f"bench ina-cost: the switch sent {results} RESULTs for "
                           f"{len(frames)} contributions of complete rounds")
    return spent / len(frames) * 1e9


def anchor_ns(lanes: int = 256, packets: int = 8192) -> float:
    """Nanoseconds per packet of ``np.add`` of its lanes into a register row."""
    src = np.random.default_rng(2).integers(-1000, 1000, (packets, lanes), dtype=np.int32)
    reg = np.zeros(lanes, np.int32)
    t = time.perf_counter()
    for k in range(packets):
        np.add(reg, src[k], out=reg)
    return (time.perf_counter() - t) / packets * 1e9


def rows(bursts=(8, 64), reps: int = 5) -> list[dict]:
    """One row per (side, burst): ns per packet (median, min, max of ``reps``), the anchor's
    median measured alternately, and their ratio."""
    ina.warm_up()
    frames, job = switch_frames()
    switch_ns(bursts[0], frames[:64], job)  # load the stage's kernels
    cpu, out = cpu_description(), []
    for burst in bursts:
        for side in ("worker", "switch"):
            got, anchors = [], []
            for _ in range(reps):
                got.append(worker_ns(burst) if side == "worker" else
                           switch_ns(burst, frames, job))
                anchors.append(anchor_ns())
            med, anc = statistics.median(got), statistics.median(anchors)
            out.append({"side": side, "burst": burst, "ns_per_packet": round(med),
                        "min_ns": round(min(got)), "max_ns": round(max(got)),
                        "anchor": "np.add 256 int32", "anchor_ns": round(anc, 1),
                        "ratio": round(med / anc, 2), "cpu": cpu})
    return out


def measure(emit, quick: bool, reps: int) -> Outcome:
    """``testbed bench ina-cost`` (:mod:`testbed.bench.protocol`)."""
    if reps < 1:
        raise ValueError(f"--reps must be at least 1, got {reps}")
    return Outcome(rows(reps=reps), {"anchor": "np.add of 256 int32 per packet"})
