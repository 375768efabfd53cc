"""Aggregation program: every protocol invariant on crafted packet sequences, the Numba kernel
against its plain-Python twin (decisions and RESULT bytes), the whole protocol under loss,
duplication and reordering (simulated channel, real kernels), and real aggregation in Mininet."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from inasim import Sim

from testbed.collectives import inakernel as ik
from testbed.collectives.reference import inakernel as ik_ref
from testbed.datapath.aggclient import header_bytes, udp_frame
from testbed.datapath.aggregate import (
    COUNTER_NAMES,
    DEFAULT_AGG_IP,
    DEFAULT_AGG_MAC,
    THC_MAX_ELEMS,
    AggregateStage,
)
from testbed.datapath.batch import PORT_DROP, PORT_HELD, PORT_UNSET, Batch
from testbed.datapath.forward import ip_to_int, mac_to_int
from testbed.datapath.reference.aggregate import AggregateReference
from testbed.kernels.wire import (
    FIELD_OFFSETS,
    HEADER_OFFSET,
    PAYLOAD_OFFSET,
    Codec,
    DropReason,
    Flags,
    MsgType,
    unpack_header,
)

R = DropReason
AGG_MAC = mac_to_int(DEFAULT_AGG_MAC).to_bytes(6, "big")
AGG_IP = ip_to_int(DEFAULT_AGG_IP).to_bytes(4, "big")
PORTS = [f"p{i}" for i in range(8)]
JOBS = {1: (3, 2, 10), 2: (2, 1, (1 << 32) - 1)}  # job -> (n_workers, slots, seq0)


def _addr(job: int, w: int) -> tuple[bytes, bytes, int, int]:
    """(MAC, IP, UDP port, ingress port index) of member ``w`` of ``job``."""
    return bytes([2, 0, 0, 0, job, w]), bytes([10, job, 0, w + 1]), 5000 + w, w


def _members(job: int, n: int, ingress_names: bool) -> list[dict]:
    out = []
    for w in range(n):
        mac, ip, port, ingress = _addr(job, w)
        out.append({"worker": w, "mac": ":".join(f"{b:02x}" for b in mac),
                    "ip": ".".join(map(str, ip)), "port": port,
                    "ingress": PORTS[ingress] if ingress_names else ingress})
    return out


def _jobs(ingress_names: bool, jobs=JOBS, lanes: int = 256) -> dict:
    return {j: {"slots": s, "seq0": q, "lanes": lanes, "members": _members(j, n, ingress_names)}
            for j, (n, s, q) in jobs.items()}


def _pair(jobs=JOBS, max_elems=16, lanes=256, **kw):
    """A kernel stage and its twin with the same jobs."""
    stage = AggregateStage(ports=PORTS, pool_slots=8, max_elems=max_elems,
                           jobs=_jobs(True, jobs, lanes), **kw)
    ref = AggregateReference(DEFAULT_AGG_MAC, DEFAULT_AGG_IP, _jobs(False, jobs, lanes),
                             max_elems=max_elems)
    return stage, ref


def frame(job, w, slot, seq, vals, mt=MsgType.DATA, codec=Codec.INT32, chunk=0, exponent=0,
          src=None, sset=None):
    """A contribution of member ``w`` (or from ``src`` = (mac, ip, port)) for round ``seq``."""
    vals = np.asarray(vals, np.int8 if codec == Codec.THC else np.int32)
    hdr = header_bytes(int(mt), job, w, slot, seq & 1 if sset is None else sset, 3, vals.size,
                       chunk, exponent=exponent, codec=int(codec), seq=seq)
    mac, ip, port, _ = _addr(job, w)
    if src is not None:
        mac, ip, port = src
    return udp_frame(mac, AGG_MAC, ip, AGG_IP, port, 41000, hdr + vals.tobytes())


def run_kernel(stage, frames, ports):
    """Decisions ``[(out_port, reason)]`` and emitted ``[(out_port, bytes)]`` of one burst."""
    b = Batch(len(frames) * 8 + 8)
    for i, (f, p) in enumerate(zip(frames, ports, strict=True)):
        b.buf[i, :len(f)] = np.frombuffer(f, np.uint8)
        b.length[i] = len(f)
        b.in_port[i] = p
    b.n = len(frames)
    stage.process(b, 0)
    decisions = [(int(b.out_port[i]), int(b.reason[i])) for i in range(len(frames))]
    results = [(int(b.out_port[i]), bytes(b.buf[i, :b.length[i]]))
               for i in range(len(frames), b.n)]
    return decisions, results


def both(stage, ref, frames, ports):
    """Run a burst through the kernel and the twin; assert they agree; return the kernel's."""
    dec, res = run_kernel(stage, frames, ports)
    exp = [ref.process(f, p) for f, p in zip(frames, ports, strict=True)]
    assert dec == [(d, int(r)) for d, r, _ in exp]
    assert res == [o for _, _, out in exp for o in out]
    return dec, res


def values_of(result: bytes) -> np.ndarray:
    h = unpack_header(result, HEADER_OFFSET)
    lane = (len(result) - PAYLOAD_OFFSET) // max(int(h["elem_count"]), 1)
    return np.frombuffer(result, {1: "<i1", 2: "<i2", 4: "<i4"}[lane], int(h["elem_count"]),
                         PAYLOAD_OFFSET).astype(np.int64)


# ------------------------------------------------------------------------- invariants, crafted


def test_complete_round_multicasts_the_exact_sum_to_registered_members_only():
    stage, ref = _pair()
    vals = [np.arange(8) * (w + 1) - 3 for w in range(3)]
    dec, res = both(stage, ref, [frame(1, w, 0, 10, vals[w]) for w in range(3)], [0, 1, 2])
    assert dec == [(PORT_HELD, 0)] * 3
    assert [p for p, _ in res] == [0, 1, 2]  # each member's registered ingress port
    for w, (_, r) in enumerate(res):
        h = unpack_header(r, HEADER_OFFSET)
        assert (h["msg_type"], h["worker_id"], h["seq"], h["slot_set"]) == (MsgType.RESULT, w, 10,
                                                                             0)
        assert r[:6] == _addr(1, w)[0] and r[30:34] == _addr(1, w)[1]
        assert int.from_bytes(r[36:38], "big") == _addr(1, w)[2]
        assert np.array_equal(values_of(r), np.sum(vals, axis=0))


def test_duplicate_contribution_of_an_open_round_is_not_added_twice():
    stage, ref = _pair()
    f0 = frame(1, 0, 0, 10, [5] * 4)
    dec, res = both(stage, ref, [f0, f0, frame(1, 0, 0, 10, [5] * 4, MsgType.RETRANSMIT)],
                    [0, 0, 0])
    assert dec == [(PORT_HELD, 0), (PORT_DROP, R.DUPLICATE), (PORT_DROP, R.DUPLICATE)] and not res
    dec, res = both(stage, ref, [frame(1, w, 0, 10, [1] * 4) for w in (1, 2)], [1, 2])
    assert len(res) == 3 and all(values_of(r).tolist() == [7] * 4 for _, r in res)
    assert stage.counters()["duplicates"] == 2


def test_retransmission_to_a_completed_round_is_answered_from_the_registers():
    stage, ref = _pair()
    fr = [frame(1, w, 1, 10, [w] * 4) for w in range(3)]
    _, res = both(stage, ref, fr, [0, 1, 2])
    for w in range(3):  # each member's result was "lost": its retransmission is answered
        dec, again = both(stage, ref, [frame(1, w, 1, 10, [w] * 4, MsgType.RETRANSMIT)], [w])
        assert dec == [(PORT_HELD, 0)] and again == [res[w]]
    assert stage.counters()["retransmissions_answered"] == 3


def test_retransmission_racing_its_original():
    """The retransmission arrives first and is counted; the original, late, is a duplicate
    while the round is open and is answered once it completed; the sum counts it once."""
    stage, ref = _pair()
    retx = frame(1, 0, 0, 10, [3] * 4, MsgType.RETRANSMIT)
    orig = frame(1, 0, 0, 10, [3] * 4)
    dec, _ = both(stage, ref, [retx, orig], [0, 0])
    assert dec == [(PORT_HELD, 0), (PORT_DROP, R.DUPLICATE)]
    _, res = both(stage, ref, [frame(1, w, 0, 10, [1] * 4) for w in (1, 2)], [1, 2])
    assert all(values_of(r).tolist() == [5] * 4 for _, r in res)
    dec, res = both(stage, ref, [orig], [0])
    assert dec == [(PORT_HELD, 0)] and len(res) == 1 and res[0][0] == 0


def test_late_packet_of_a_previous_round_is_stale_and_cannot_start_a_round():
    """The hang of single-bit SwitchML sets: a delayed round-10 packet arriving once round 12
    (same register set) is under way must not be added to it nor wedge the slot; while round
    10 is still in its set it is just answered again."""
    stage, ref = _pair()
    late = frame(1, 2, 0, 10, [100] * 4)
    both(stage, ref, [frame(1, w, 0, 10, [1] * 4) for w in range(3)], [0, 1, 2])
    both(stage, ref, [frame(1, w, 0, 11, [2] * 4) for w in range(3)], [0, 1, 2])
    dec, res = both(stage, ref, [late], [2])
    assert dec == [(PORT_HELD, 0)] and values_of(res[0][1]).tolist() == [3] * 4
    both(stage, ref, [frame(1, 0, 0, 12, [3] * 4)], [0])  # round 12 now holds set 0
    dec, res = both(stage, ref, [late], [2])
    assert dec == [(PORT_DROP, R.STALE)] and not res
    _, res = both(stage, ref, [frame(1, w, 0, 12, [3] * 4) for w in (1, 2)], [1, 2])
    assert len(res) == 3 and all(values_of(r).tolist() == [9] * 4 for _, r in res)
    dec, _ = both(stage, ref, [frame(1, 0, 0, 10, [1] * 4)], [0])  # long gone
    assert dec == [(PORT_DROP, R.STALE)]


def test_rounds_the_protocol_cannot_have_reached_are_refused():
    stage, ref = _pair()
    dec, _ = both(stage, ref, [frame(1, 0, 0, 12, [1] * 4)], [0])  # before round 10 and 11
    assert dec == [(PORT_DROP, R.BAD_SEQ)]
    both(stage, ref, [frame(1, 0, 0, 10, [1] * 4)], [0])  # round 10 open
    dec, _ = both(stage, ref, [frame(1, 1, 0, 11, [1] * 4)], [1])  # 11 needs 10 complete
    assert dec == [(PORT_DROP, R.BAD_SEQ)]
    dec, _ = both(stage, ref, [frame(1, 1, 0, 10, [1] * 4, sset=1)], [1])  # set bit != seq & 1
    assert dec == [(PORT_DROP, R.BAD_SLOT)]
    dec, _ = both(stage, ref, [frame(1, 0, 0, 1 << 31, [1] * 4)], [0])
    assert dec == [(PORT_DROP, R.BAD_SEQ)]
    assert stage.counters()["bad_seq"] == 3


def test_rounds_wrap_around_32_bits():
    stage, ref = _pair()  # job 2 starts at round 2**32 - 1
    for r in ((1 << 32) - 1, 0, 1, 2):
        _, res = both(stage, ref, [frame(2, w, 0, r & 0xFFFFFFFF, [r % 7] * 2) for w in (0, 1)],
                      [0, 1])
        assert len(res) == 2 and values_of(res[0][1]).tolist() == [2 * (r % 7)] * 2


def test_stranger_with_a_members_identity_is_not_a_member():
    """DATA with the job's id, a member's worker id and slot from another MAC, IP or UDP port,
    or from the member's own addresses on another ingress port: dropped NOT_MEMBER, nothing
    added; the real members' sum is exact."""
    stage, ref = _pair()
    mac, ip, port, _ = _addr(1, 0)
    other_mac, other_ip = bytes([2, 0, 0, 0, 9, 9]), bytes([10, 9, 9, 9])
    strangers = [frame(1, 0, 0, 10, [99] * 4, src=s) for s in
                 ((other_mac, ip, port), (mac, other_ip, port), (mac, ip, port + 1))]
    dec, _ = both(stage, ref, strangers + [frame(1, 0, 0, 10, [99] * 4)], [0, 0, 0, 3])
    assert dec == [(PORT_DROP, R.NOT_MEMBER)] * 4
    _, res = both(stage, ref, [frame(1, w, 0, 10, [1] * 4) for w in range(3)], [0, 1, 2])
    assert all(values_of(r).tolist() == [3] * 4 for _, r in res)
    assert stage.counters()["not_member"] == 4


def test_malformed_and_unknown_are_dropped_with_their_reason():
    stage, ref = _pair()
    good = frame(1, 0, 0, 10, [1] * 4)

    def mutate(off, value):
        f = bytearray(good)
        f[off:off + len(value)] = value
        return bytes(f)

    o = HEADER_OFFSET + np.array(list(FIELD_OFFSETS.values()))
    fo = dict(zip(FIELD_OFFSETS, o.tolist(), strict=True))
    cases = {
        R.BAD_MAGIC: mutate(fo["magic"], b"\0\0"),
        R.BAD_VERSION: mutate(fo["version"], b"\x09"),
        R.UNKNOWN_TYPE: mutate(fo["msg_type"], bytes([MsgType.RESULT])),
        R.UNKNOWN_JOB: mutate(fo["job_id"], b"\x4d\0"),
        R.BAD_WORKER: mutate(fo["worker_id"], b"\x1f\0"),
        R.BAD_SLOT: mutate(fo["slot"], b"\x07\0"),
        R.BAD_LENGTH: good[:-4],
        R.IP_OPTIONS: mutate(14, b"\x46"),
        R.BAD_CODEC: frame(1, 0, 0, 10, [1] * 4, codec=Codec.FLOAT32),
    }
    for reason, f in cases.items():
        dec, res = both(stage, ref, [f], [0])
        assert dec == [(PORT_DROP, reason)] and not res, reason


def test_element_count_codec_and_chunk_must_match_the_round():
    stage, ref = _pair()
    both(stage, ref, [frame(1, 0, 0, 10, [1] * 4, chunk=256)], [0])
    for f, reason in ((frame(1, 1, 0, 10, [1] * 5, chunk=256), R.ELEM_MISMATCH),
                      (frame(1, 1, 0, 10, [1] * 4, chunk=512), R.ELEM_MISMATCH),
                      (frame(1, 1, 0, 10, [1] * 4, chunk=256, codec=Codec.THC), R.BAD_CODEC)):
        assert both(stage, ref, [f], [1])[0] == [(PORT_DROP, reason)]


def test_a_dead_member_stalls_only_its_job_and_reset_restarts_it():
    stage, ref = _pair()
    both(stage, ref, [frame(1, w, 0, 10, [1] * 4) for w in (0, 1)], [0, 1])  # member 2 died
    _, res = both(stage, ref, [frame(2, w, 0, (1 << 32) - 1, [4] * 2) for w in (0, 1)], [0, 1])
    assert len(res) == 2  # the other job is not affected
    stage.reset_job(1)
    ref.add_job(1, _jobs(False)[1])
    _, res = both(stage, ref, [frame(1, w, 0, 10, [2] * 4) for w in range(3)], [0, 1, 2])
    assert all(values_of(r).tolist() == [6] * 4 for _, r in res)


# --------------------------------------------------------------------- kernel == twin, random

event = st.tuples(
    st.sampled_from(sorted(JOBS)), st.integers(0, 3), st.integers(0, 2), st.integers(-2, 4),
    st.sampled_from([MsgType.DATA, MsgType.RETRANSMIT]),
    st.sampled_from([None] * 8 + ["stranger", "port", "magic", "trunc", "type", "elems",
                                  "codec", "set"]),
    st.integers(1, 16))


@settings(max_examples=80, deadline=None)
@given(st.lists(event, min_size=1, max_size=60), st.integers(1, 8))
def test_kernel_matches_twin_on_random_sequences(events, burst):
    """Members, strangers, rounds around the current ones, duplicates, retransmissions and
    malformed packets in random order: the kernel and the twin take the same decision for
    every packet and emit the same RESULT bytes."""
    stage, ref = _pair()
    frames, ports = [], []
    rng = np.random.default_rng(len(events))
    for job, w, slot, dr, mt, bad, ne in events:
        n, slots, seq0 = JOBS[job]
        vals = rng.integers(-(1 << 31), 1 << 31, ne).astype(np.int32)
        src = (bytes(6), bytes(4), 1) if bad == "stranger" else None
        f = bytearray(frame(job, w % (n + 1), slot % (slots + 1), (seq0 + dr) & 0xFFFFFFFF,
                            vals, mt, src=src, codec=Codec.THC if bad == "codec" else Codec.INT32,
                            sset=((seq0 + dr) & 1) ^ (bad == "set")))
        if bad == "magic":
            f[HEADER_OFFSET] ^= 0xFF
        elif bad == "trunc":
            f = f[:-3]
        elif bad == "type":
            f[HEADER_OFFSET + FIELD_OFFSETS["msg_type"]] = 9
        elif bad == "elems":
            f[HEADER_OFFSET + FIELD_OFFSETS["elem_count"]] += 1
        frames.append(bytes(f))
        ports.append((w + (bad == "port")) % len(PORTS))
    for lo in range(0, len(frames), burst):
        both(stage, ref, frames[lo:lo + burst], ports[lo:lo + burst])


# ------------------------------------------------------------------------------ THC lanes


@pytest.mark.parametrize("n", [2, 5, 8])
def test_thc_int8_lanes_exact_sums(n):
    """THC: int8 lanes summed exactly in int32 registers; the RESULT comes back in the
    narrowest lane that holds the sums; kernel == twin byte for byte, answers included."""
    rng = np.random.default_rng(n)
    jobs = {5: (n, 2, 0)}
    stage, ref = _pair(jobs, lanes=THC_MAX_ELEMS)
    ports = list(range(n))
    for k, hi, ne in ((0, 8, 1024), (1, 127, 600)):
        vals = [rng.integers(-hi, hi + 1, ne) for _ in range(n)]
        vals[0][:2] = (-hi, hi)
        frames = [frame(5, w, k, 0, vals[w], codec=Codec.THC) for w in range(n)]  # slot k
        dec, res = both(stage, ref, frames, ports)
        want = np.sum(vals, axis=0, dtype=np.int64)
        lane = 1 if -128 <= want.min() and want.max() <= 127 else 2
        assert dec == [(PORT_HELD, 0)] * n and len(res) == n
        for _, fr in res:
            assert (len(fr) - PAYLOAD_OFFSET) // ne == lane
            assert np.array_equal(values_of(fr), want)
        dec, again = both(stage, ref, [frame(5, n - 1, k, 0, vals[n - 1], MsgType.RETRANSMIT,
                                             codec=Codec.THC)], [ports[n - 1]])
        assert dec == [(PORT_HELD, 0)] and again == [res[n - 1]]


def test_thc_overflow_flag_and_codec_checks():
    """Sums that fit no lane within the MTU -> OVERFLOW and no payload (never wrapped); THC
    length/limit checks; a switch configured for INT32 only refuses THC."""
    stage, ref = _pair({1: (2, 2, 0)}, lanes=THC_MAX_ELEMS)
    big = np.full(1024, 100, np.int8)  # sums 200: int16 x 1024 = 2048 B > MTU
    _, res = both(stage, ref, [frame(1, w, 0, 0, big, codec=Codec.THC) for w in (0, 1)], [0, 1])
    for _, fr in res:
        h = unpack_header(fr, HEADER_OFFSET)
        assert int(h["flags"]) == int(Flags.OVERFLOW) and len(fr) == PAYLOAD_OFFSET
    too_many = frame(1, 0, 1, 0, np.ones(THC_MAX_ELEMS + 1, np.int8), codec=Codec.THC)
    short = bytearray(frame(1, 0, 1, 0, np.ones(8, np.int8), codec=Codec.THC))
    short[HEADER_OFFSET + FIELD_OFFSETS["elem_count"]] = 9
    for f in (too_many, bytes(short)):
        assert both(stage, ref, [f], [0])[0] == [(PORT_DROP, R.BAD_LENGTH)]
    only = AggregateStage(ports=PORTS, pool_slots=2, max_elems=16, codecs=["INT32"],
                          jobs=_jobs(True, {1: (2, 2, 0)}))
    t8 = frame(1, 1, 0, 0, np.ones(4, np.int8), codec=Codec.THC)
    assert run_kernel(only, [t8], [1])[0] == [(PORT_DROP, R.BAD_CODEC)]
    only.configure(codecs=["INT32", "THC"])
    assert run_kernel(only, [t8], [1])[0] == [(PORT_HELD, 0)]


# ------------------------------------------------------------------- ARP, config, counters


def test_not_for_aggregator_falls_through_and_arp_answered():
    stage, _ = _pair()
    other = udp_frame(b"\x02\0\0\0\0\1", b"\x02\0\0\0\0\2", bytes([10, 0, 0, 1]),
                      bytes([10, 0, 0, 2]), 1, 41000, b"x" * 40)
    arp = (b"\xff" * 6 + b"\x02\0\0\0\0\1" + b"\x08\x06" + bytes.fromhex("0001080006040001")
           + b"\x02\0\0\0\0\1" + bytes([10, 0, 0, 1]) + b"\0" * 6 + AGG_IP)
    b = Batch(4)
    for i, f in enumerate((other, arp)):
        b.buf[i, :len(f)] = np.frombuffer(f, np.uint8)
        b.length[i] = len(f)
        b.in_port[i] = 2 * i
    b.n = 2
    stage.process(b, 0)
    assert (b.out_port[0], b.out_port[1]) == (PORT_UNSET, 2)
    reply = bytes(b.buf[1, :len(arp)])
    assert reply[:6] == b"\x02\0\0\0\0\1" and reply[6:12] == AGG_MAC
    assert reply[20:22] == b"\0\x02" and reply[28:32] == AGG_IP and reply[38:42] == bytes(
        [10, 0, 0, 1])
    assert stage.counters()["arp_replies"] == 1


def test_job_partitions_and_bad_config():
    stage = AggregateStage(ports=["a", "b"], pool_slots=10, max_elems=8)
    m2 = [{"worker": w, "mac": f"02:00:00:00:00:0{w + 1}", "ip": f"10.0.0.{w + 1}",
           "port": 20001, "ingress": ["a", "b"][w]} for w in range(2)]
    stage.configure(jobs={"5": {"slots": 6, "members": m2}})
    with pytest.raises(ValueError, match="only 4 are free"):
        stage.configure(jobs={6: {"slots": 5, "members": m2}})
    stage.configure(jobs={6: {"slots": 4, "members": m2}})
    assert stage.jobs[5]["base"] + 6 <= stage.jobs[6]["base"]
    stage.configure(remove_jobs=[5])
    assert stage.free_slots() == 6
    with pytest.raises(ValueError, match="needs 1..32 members"):
        stage.add_job(7, {"slots": 1, "members": []})
    with pytest.raises(ValueError, match="workers must be 0..1"):
        stage.add_job(7, {"slots": 1, "members": [m2[0], m2[0]]})
    with pytest.raises(ValueError, match="missing"):
        stage.add_job(7, {"slots": 1, "members": [{"worker": 0, "mac": "02:00:00:00:00:01"}]})
    with pytest.raises(ValueError, match="unknown port 'zz'"):
        stage.add_job(7, {"slots": 1, "members": [dict(m2[0], ingress="zz")]})
    with pytest.raises(ValueError, match="mode must be"):
        stage.add_job(7, {"slots": 1, "members": m2, "mode": "greedy"})
    with pytest.raises(ValueError, match="unknown keys"):
        stage.configure(jobs={7: {"slots": 1, "n_workers": 2, "members": m2}})
    with pytest.raises(ValueError, match="unknown settings"):
        stage.configure(slotz=3)
    with pytest.raises(ValueError, match="max_elems"):
        AggregateStage(max_elems=10_000)
    with pytest.raises(ValueError, match="no job 9"):
        stage.reset_job(9)
    assert set(COUNTER_NAMES) <= set(stage.counters())


def test_results_via_forward_leaves_routing_to_forward():
    stage, _ = _pair(results_via="forward")
    _, res = run_kernel(stage, [frame(2, w, 0, (1 << 32) - 1, [1] * 8) for w in (0, 1)], [0, 1])
    assert [p for p, _ in res] == [PORT_UNSET, PORT_UNSET]
    with pytest.raises(ValueError, match="results_via"):
        stage.configure(results_via="multicast")


# --------------------------------------------- the whole protocol under impairments (simulated)


@pytest.mark.parametrize("loss, dup, reorder", [(0, 0, 0), (0.05, 0, 0), (0, 0.2, 0),
                                                (0, 0, 0.3), (0.1, 0.1, 0.3), (0.3, 0.3, 0.5)])
def test_protocol_exact_under_loss_duplication_reordering(loss, dup, reorder):
    """Real worker kernels and the real switch kernel over a seeded channel that loses,
    duplicates and reorders packets both ways: every worker holds the exact int32 sum, twice
    in a row (rounds continue across repetitions), and nothing hangs."""
    for seed in range(3):
        sim = Sim(n=4, W=6, count=3000, seed=seed, loss=loss, dup=dup, reorder=reorder, reps=2)
        ps = sim.run()
        want = sim.expected_qsum(ps[0])
        assert all(np.array_equal(p.qsum, want) for p in ps), (seed, sim.stats)
        assert all(np.isfinite(p.out).all() for p in ps)


@pytest.mark.parametrize("seed", range(6))
def test_protocol_twins_agree_in_lockstep(seed):
    """The same impaired run with the kernels and with both twins (worker and switch): same
    packets sent, same drops by reason, same outputs."""
    rng = np.random.default_rng(seed)
    kw = dict(n=int(rng.integers(1, 6)), W=int(rng.integers(1, 6)),
              count=int(rng.integers(1, 2500)), loss=0.1, dup=0.1, reorder=0.3, seed=seed,
              seq0=int(rng.integers(0, 1 << 32)))
    a, b = Sim(**kw), Sim(**kw, kernels=ik_ref, switch="reference")
    pa, pb = a.run(), b.run()
    assert a.stats["to_switch"] == b.stats["to_switch"]
    assert {int(k): v for k, v in a.stats["switch_drops"].items()} == \
        {int(k): v for k, v in b.stats["switch_drops"].items()}
    for x, y in zip(pa, pb, strict=True):
        assert np.array_equal(x.qsum, y.qsum) and np.array_equal(x.out, y.out)
        assert np.array_equal(x.qsum, a.expected_qsum(pa[0]))
    assert ik.FAST_RETX >= 1


# ------------------------------------------------------------------------------ Mininet


@pytest.fixture(scope="module")
def star8():
    """8 hosts around one programmable switch (aggregate + forward), built once."""
    from testbed.topologies import Star, TestbedNet

    with TestbedNet(Star(8, bw_mbps=None, switch="programmable")) as net:
        yield net


def _check(spec, xs, outs):
    want = np.sum(np.stack([x.astype(np.float64) for x in xs]), axis=0)
    from testbed.collectives.report import check

    err, ok = check(spec, xs, outs, len(xs))
    assert ok, (err, np.max(np.abs(np.asarray(outs[0], np.float64) - want)))


@pytest.mark.mininet
@pytest.mark.parametrize("n", [2, 5, 8])
def test_exact_sum_n_workers_real_sockets(star8, n):
    """n workers on real UDP sockets through the switch's registered membership."""
    from testbed.collectives.spec import CollectiveSpec
    from testbed.collectives.testing import run_direct

    spec = CollectiveSpec(algo="ina", nbytes=4 * 3000, window=8, timeout_s=30, job_id=10 + n)
    xs, outs, _ = run_direct(star8, spec, n)
    _check(spec, xs, outs)
    agg = star8.switch_client("tbs1").counters()["stages"]["aggregate"]
    assert agg["not_member"] == 0 and agg["jobs"] == {}


@pytest.mark.mininet
def test_two_jobs_concurrently_never_mix(star8):
    """Two jobs share the switch at once on disjoint partitions and hosts; each gets its sum."""
    from testbed.collectives.spec import CollectiveSpec
    from testbed.collectives.testing import run_direct

    out = {}

    def job(jid, hosts):
        spec = CollectiveSpec(algo="ina", nbytes=4 * 5000, window=8, timeout_s=30, job_id=jid,
                              seed=jid)
        out[jid] = (spec, run_direct(star8, spec, 4, hosts=hosts))

    ts = [threading.Thread(target=job, args=(101, star8.hosts[:4])),
          threading.Thread(target=job, args=(102, star8.hosts[4:]))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert set(out) == {101, 102}
    for spec, (xs, outs, _) in out.values():
        _check(spec, xs, outs)


def test_protocol_exact_through_smartnic_codecs_under_impairments():
    """algo='nic': float32 packets cross each worker's SmartNIC codec kernels (fixed32 encode
    out, decode in) around the switch, over an impaired channel: every worker holds exactly
    the ATP fixed-point sum."""
    sim = Sim(n=3, W=5, count=2000, mode=ik.MODE_NIC, seed=4, loss=0.1, dup=0.1, reorder=0.3)
    ps = sim.run()
    want = sim.expected_nic()
    assert all(np.array_equal(p.out, want) for p in ps)


# ------------------------------------------------------------- trees, memory and the shared pool

PARENT = {"mac": "02:54:42:01:00:00", "ip": "10.254.0.1", "index": 3}
PARENT_MAC, PARENT_IP = bytes.fromhex("025442010000"), bytes([10, 254, 0, 1])
UPLINK = 7  # the port towards the parent


def _tree_pair(lanes=256, n=2):
    """A leaf switch (2 members, parent on port 7): kernel and twin."""
    job = {1: (n, 2, 10)}
    kj, rj = _jobs(True, job, lanes), _jobs(False, job, lanes)
    kj[1]["parent"] = dict(PARENT, egress=PORTS[UPLINK])
    rj[1]["parent"] = dict(PARENT, egress=UPLINK)
    stage = AggregateStage(ports=PORTS, pool_slots=8, max_elems=16, jobs=kj)
    ref = AggregateReference(DEFAULT_AGG_MAC, DEFAULT_AGG_IP, rj, max_elems=16)
    return stage, ref


def parent_result(seq, vals, slot=0, chunk=0, codec=Codec.INT32, flags=0, exponent=0):
    vals = np.asarray(vals, np.int32 if codec != Codec.THC else np.int8)
    hdr = header_bytes(int(MsgType.RESULT), 1, PARENT["index"], slot, seq & 1, 2, vals.size,
                       chunk, exponent=exponent, codec=int(codec), flags=flags, seq=seq)
    return udp_frame(PARENT_MAC, AGG_MAC, PARENT_IP, AGG_IP, 41000, 41000, hdr + vals.tobytes())


def test_tree_node_sends_its_partial_sum_up_and_multicasts_the_parents_result():
    stage, ref = _tree_pair()
    dec, out = both(stage, ref, [frame(1, w, 0, 10, [w + 1] * 4, exponent=w) for w in (0, 1)],
                    [0, 1])
    assert dec == [(PORT_HELD, 0)] * 2 and len(out) == 1 and out[0][0] == UPLINK
    up = unpack_header(out[0][1], HEADER_OFFSET)
    assert (up["msg_type"], up["worker_id"], up["seq"], up["exponent"]) == (MsgType.DATA, 3, 10,
                                                                            1)
    assert out[0][1][:6] == PARENT_MAC and out[0][1][6:12] == AGG_MAC
    assert values_of(out[0][1]).tolist() == [3] * 4  # the partial sum
    # a member retransmits while the parent has not answered: the partial goes up again
    dec, again = both(stage, ref, [frame(1, 0, 0, 10, [1] * 4, MsgType.RETRANSMIT)], [0])
    assert dec == [(PORT_HELD, 0)] and again[0][0] == UPLINK
    assert unpack_header(again[0][1], HEADER_OFFSET)["msg_type"] == MsgType.RETRANSMIT
    # the parent's RESULT (the whole tree's sum) comes down to every member
    dec, down = both(stage, ref, [parent_result(10, [11] * 4, exponent=5)], [UPLINK])
    assert dec == [(PORT_HELD, 0)] and [p for p, _ in down] == [0, 1]
    assert all(values_of(f).tolist() == [11] * 4 for _, f in down)
    assert unpack_header(down[0][1], HEADER_OFFSET)["exponent"] == 5
    # a duplicate RESULT, or one from anywhere but the parent's port, changes nothing
    assert both(stage, ref, [parent_result(10, [11] * 4)], [UPLINK])[0] == \
        [(PORT_DROP, R.DUPLICATE)]
    assert both(stage, ref, [parent_result(11, [1] * 4)], [0])[0] == [(PORT_DROP, R.UNKNOWN_TYPE)]
    # now done: a member's lost result is answered from the registers
    _, ans = both(stage, ref, [frame(1, 1, 0, 10, [2] * 4, MsgType.RETRANSMIT)], [1])
    assert ans == [down[1]]
    c = stage.counters()
    assert (c["upward_sent"], c["upward_resent"], c["parent_results"]) == (1, 1, 1)


def test_tree_node_sends_one_partial_sum_up_for_members_asking_together():
    """T2: members whose timers fire together for one late parent RESULT cost one resend up,
    not one each; a member asking a second time is a new request and gets its resend."""
    stage, ref = _tree_pair(n=4)
    both(stage, ref, [frame(1, w, 0, 10, [w + 1] * 4) for w in range(4)], [0, 1, 2, 3])

    def ask(w):
        dec, out = both(stage, ref, [frame(1, w, 0, 10, [w + 1] * 4, MsgType.RETRANSMIT)], [w])
        return dec[0] == (PORT_HELD, 0) and [p for p, _ in out] == [UPLINK], dec

    assert ask(0)[0]  # the first request after the send up: resend
    assert [ask(w)[1] for w in (1, 2)] == [[(PORT_DROP, R.DUPLICATE)]] * 2  # covered by it
    assert ask(1)[0]  # member 1 asks again: that resend was not enough, resend
    assert not ask(3)[0] and not ask(0)[0]  # covered by the second resend
    assert ask(3)[0]
    c = stage.counters()
    assert (c["upward_sent"], c["upward_resent"], c["upward_coalesced"]) == (1, 3, 4)
    # the parent's RESULT comes down to everyone; the next round's requests start afresh
    _, down = both(stage, ref, [parent_result(10, [10] * 4)], [UPLINK])
    assert [p for p, _ in down] == [0, 1, 2, 3]
    both(stage, ref, [frame(1, w, 0, 11, [1] * 4) for w in range(4)], [0, 1, 2, 3])
    dec, again = both(stage, ref, [frame(1, 2, 0, 11, [1] * 4, MsgType.RETRANSMIT)], [2])
    assert dec == [(PORT_HELD, 0)] and [p for p, _ in again] == [UPLINK]


def test_tree_node_rounds_wait_for_the_parent():
    """A round sent up is not done: the next round of that slot cannot start before the
    parent's RESULT came back (every member needs it first)."""
    stage, ref = _tree_pair()
    both(stage, ref, [frame(1, w, 0, 10, [1] * 4) for w in (0, 1)], [0, 1])
    assert both(stage, ref, [frame(1, 0, 0, 11, [1] * 4)], [0])[0] == [(PORT_DROP, R.BAD_SEQ)]
    both(stage, ref, [parent_result(10, [4] * 4)], [UPLINK])
    assert both(stage, ref, [frame(1, 0, 0, 11, [1] * 4)], [0])[0] == [(PORT_HELD, 0)]


def test_thc_partial_sums_travel_in_wider_lanes():
    """THC: two children's int8 levels add up beyond int8: the partial goes up in int16 lanes,
    and the parent accepts int16 lanes from a child switch."""
    stage, ref = _tree_pair(lanes=THC_MAX_ELEMS)
    vals = [np.full(600, 100, np.int8), np.full(600, 100, np.int8)]
    _, out = both(stage, ref, [frame(1, w, 0, 10, vals[w], codec=Codec.THC) for w in (0, 1)],
                  [0, 1])
    assert (len(out[0][1]) - PAYLOAD_OFFSET) // 600 == 2
    assert values_of(out[0][1]).tolist() == [200] * 600
    # as a contribution at a root with that child as member: accepted and added
    root = AggregateStage(ports=PORTS, pool_slots=8, jobs={1: {
        "slots": 2, "seq0": 10, "lanes": THC_MAX_ELEMS, "members": [
            {"worker": 0, "mac": DEFAULT_AGG_MAC, "ip": DEFAULT_AGG_IP, "port": 41000,
             "ingress": "p0"}]}})
    up = bytearray(out[0][1])
    up[0:6] = PARENT_MAC  # addressed to the root ...
    up[30:34] = PARENT_IP
    up[HEADER_OFFSET + FIELD_OFFSETS["worker_id"]] = 0  # ... whose only member it is
    root.configure(agg_mac=PARENT["mac"], agg_ip=PARENT["ip"])
    dec, res = run_kernel(root, [bytes(up)], [0])
    assert dec == [(PORT_HELD, 0)] and values_of(res[0][1]).tolist() == [200] * 600


def test_overflow_is_said_all_the_way_down():
    """A child's partial that fit no lane comes up flagged OVERFLOW with no payload: the round
    completes and says OVERFLOW (never a wrapped sum); the parent's OVERFLOW comes down."""
    stage, ref = _tree_pair(lanes=THC_MAX_ELEMS)
    big = np.full(1024, 100, np.int8)  # 200 per lane: int16 x 1024 > MTU
    _, out = both(stage, ref, [frame(1, w, 0, 10, big, codec=Codec.THC) for w in (0, 1)],
                  [0, 1])
    h = unpack_header(out[0][1], HEADER_OFFSET)
    assert int(h["flags"]) == int(Flags.OVERFLOW) and len(out[0][1]) == PAYLOAD_OFFSET
    res = bytearray(parent_result(10, [], codec=Codec.THC, flags=int(Flags.OVERFLOW)))
    res[HEADER_OFFSET + FIELD_OFFSETS["elem_count"]:][:2] = (1024).to_bytes(2, "little")
    _, down = both(stage, ref, [bytes(res)], [UPLINK])
    assert all(int(unpack_header(f, HEADER_OFFSET)["flags"]) == int(Flags.OVERFLOW)
               for _, f in down)


def test_memory_is_a_resource_admission_names_what_is_free():
    stage = AggregateStage(ports=["a", "b"], memory_bytes=64 << 10, pool_bytes=0)
    m2 = [{"worker": w, "mac": f"02:00:00:00:00:0{w + 1}", "ip": f"10.0.0.{w + 1}",
           "port": 20001, "ingress": ["a", "b"][w]} for w in range(2)]
    stage.configure(jobs={1: {"slots": 16, "lanes": 256, "members": m2}})  # 32 KiB
    c = stage.counters()
    assert c["memory"]["configured_bytes"] == 64 << 10
    assert c["memory"]["allocated_bytes"] == c["jobs"]["1"]["memory_bytes"] == 32 << 10
    with pytest.raises(ValueError, match=r"needs 65536 B .* only 32768 B are free"):
        stage.configure(jobs={2: {"slots": 32, "lanes": 256, "members": m2}})
    stage.configure(jobs={2: {"slots": 8, "lanes": 512, "members": m2}})  # exactly the rest
    assert stage.free_memory_bytes() == 0
    stage.configure(remove_jobs=[1])
    assert stage.free_memory_bytes() == 32 << 10
    with pytest.raises(ValueError, match="shared pool"):
        stage.configure(jobs={3: {"slots": 1, "members": m2, "mode": "shared", "fallback": {
            "mac": "02:00:00:00:00:09", "ip": "10.0.0.9", "port": 41000, "egress": "a"}}})


FB = {"mac": "02:54:42:0f:00:01", "ip": "10.253.0.1", "port": 41000}


FB2 = {"mac": "02:54:42:0f:00:02", "ip": "10.253.0.2", "port": 41001}


def _shared_pair(entries, jobs=None, two_fallbacks=False):
    """A switch whose jobs (default: job 1, 2 members, 3 slots) run in shared mode on a pool of
    ``entries`` entries, the fallback behind port 6 (and a second one behind port 7)."""
    jobs = jobs or {1: (2, 3, 10)}
    kj, rj = _jobs(True, jobs), _jobs(False, jobs)
    for j in jobs:
        if two_fallbacks:  # slot s overflows to fallback s % 2
            kj[j].update(mode="shared", fallback=[dict(FB, egress=PORTS[6]),
                                                  dict(FB2, egress=PORTS[7])])
            rj[j].update(mode="shared", fallback=[dict(FB, egress=6), dict(FB2, egress=7)])
        else:
            kj[j].update(mode="shared", fallback=dict(FB, egress=PORTS[6]))
            rj[j].update(mode="shared", fallback=dict(FB, egress=6))
    stage = AggregateStage(ports=PORTS, pool_slots=8, max_elems=16, jobs=kj,
                           pool_bytes=entries * 4 * 256, memory_bytes=64 << 10)
    ref = AggregateReference(DEFAULT_AGG_MAC, DEFAULT_AGG_IP, rj, max_elems=16,
                             pool_entries=entries, pool_lanes=256)
    return stage, ref


def both_fwd(stage, ref, frames, ports):
    """:func:`both`, and the frames forwarded to a host fallback agree byte for byte; returns
    (decisions, emitted, the forwarded frames: None where not forwarded)."""
    b = Batch(len(frames) * 8 + 8)
    for i, (f, p) in enumerate(zip(frames, ports, strict=True)):
        b.buf[i, :len(f)] = np.frombuffer(f, np.uint8)
        b.length[i], b.in_port[i] = len(f), p
    b.n = len(frames)
    stage.process(b, 0)
    dec = [(int(b.out_port[i]), int(b.reason[i])) for i in range(len(frames))]
    res = [(int(b.out_port[i]), bytes(b.buf[i, :b.length[i]])) for i in range(len(frames), b.n)]
    exp, fwd = [], []
    for i, (f, p) in enumerate(zip(frames, ports, strict=True)):
        d, r, out = ref.process(f, p)
        exp.append((d, int(r), out))
        fwd.append(bytes(b.buf[i, :b.length[i]]) if d >= 0 else None)
        if d >= 0:
            assert fwd[-1] == ref.last_frame
    assert dec == [(d, r) for d, r, _ in exp]
    assert res == [o for _, _, out in exp for o in out]
    return dec, res, fwd


def _held(stage) -> int:
    return stage.counters()["memory"]["pool_entries_held"]


def test_pool_entry_is_claimed_per_round_and_given_back_once_every_member_has_the_result():
    """A round claims a pool entry with its first contribution; after its RESULT the entry keeps
    the sum for a member that lost it, until every member has contributed to the slot's next
    round (so had the result, W1); then the entry is free, and a late retransmission of the
    round is STALE: it is never answered from an entry another round may hold now."""
    stage, ref = _shared_pair(entries=4)
    assert both(stage, ref, [frame(1, 0, 0, 10, [1] * 4)], [0])[0] == [(PORT_HELD, 0)]
    assert _held(stage) == 1
    _, out = both(stage, ref, [frame(1, 1, 0, 10, [2] * 4)], [1])
    assert [p for p, _ in out] == [0, 1] and all(values_of(f).tolist() == [3] * 4 for _, f in out)
    assert _held(stage) == 1  # kept: a member may have lost its result
    _, ans = both(stage, ref, [frame(1, 1, 0, 10, [2] * 4, MsgType.RETRANSMIT)], [1])
    assert ans == [out[1]]
    # round 11 (the other set) claims its own entry; worker 1 still lacks round 10's result
    assert both(stage, ref, [frame(1, 0, 0, 11, [5] * 4)], [0])[0] == [(PORT_HELD, 0)]
    assert _held(stage) == 2
    _, ans = both(stage, ref, [frame(1, 1, 0, 10, [2] * 4, MsgType.RETRANSMIT)], [1])
    assert ans == [out[1]]
    _, out11 = both(stage, ref, [frame(1, 1, 0, 11, [6] * 4)], [1])
    assert all(values_of(f).tolist() == [11] * 4 for _, f in out11)
    assert _held(stage) == 1  # round 10's entry is free: both members sent round 11
    assert both(stage, ref, [frame(1, 0, 0, 10, [1] * 4, MsgType.RETRANSMIT)], [0])[0] == \
        [(PORT_DROP, R.STALE)]
    c = stage.counters()
    assert (c["pool_claims"], c["pool_releases"], c["pool_collisions"]) == (2, 1, 0)
    assert c["jobs"]["1"]["memory_bytes"] == 1024 and c["jobs"]["1"]["slots_in_memory"] == 1
    stage.configure(remove_jobs=[1])
    assert _held(stage) == 0


@pytest.mark.parametrize("two_fallbacks", [False, True])
def test_round_whose_entries_are_held_goes_to_the_host_for_that_round_only(two_fallbacks):
    """A pool of one entry: a round that finds it held sends every contribution of it
    (retransmissions too) to the slot's host aggregator (slot % number of fallbacks),
    readdressed from the switch's identity with the member in the header; a duplicate of the
    round half-aggregated in the switch is not added; once a round saw every member the entry
    of the round before is free and the slot's next round is summed in the switch again."""
    stage, ref = _shared_pair(entries=1, two_fallbacks=two_fallbacks)
    x = 1 if two_fallbacks else 0  # slot 1's fallback
    assert both(stage, ref, [frame(1, 0, 0, 10, [1] * 4)], [0])[0] == [(PORT_HELD, 0)]
    for w in (0, 1):  # slot 1, round 10: the only entry is held
        dec, res, fwd = both_fwd(stage, ref, [frame(1, w, 1, 10, [w + 7] * 4)], [w])
        assert dec == [(6 + x, 0)] and res == []
        f = fwd[0]
        assert f[0:6] == bytes.fromhex(f"0254420f000{x + 1}") and f[30:34] == \
            bytes([10, 253, 0, 1 + x]) and f[26:30] == bytes([10, 0, 0, 254])
        assert f[6:12] == AGG_MAC and f[34:36] == (41000).to_bytes(2, "big")
        assert f[36:38] == (41000 + x).to_bytes(2, "big")
        assert f[42:] == frame(1, w, 1, 10, [w + 7] * 4)[42:]  # the member stays in the header
    dec, _, _ = both_fwd(stage, ref, [frame(1, 0, 1, 10, [7] * 4, MsgType.RETRANSMIT)], [0])
    assert dec == [(6 + x, 0)]  # F2: the host's round stays the host's
    assert both(stage, ref, [frame(1, 0, 0, 10, [1] * 4, MsgType.RETRANSMIT)], [0])[0] == \
        [(PORT_DROP, R.DUPLICATE)]
    _, out = both(stage, ref, [frame(1, 1, 0, 10, [2] * 4)], [1])
    assert all(values_of(f).tolist() == [3] * 4 for _, f in out)
    # slot 1's round 11 and slot 0's round 11 find the entry held by slot 0's round 10 ...
    for w in (0, 1):
        assert both_fwd(stage, ref, [frame(1, w, 1, 11, [1] * 4)], [w])[0] == [(6 + x, 0)]
    assert _held(stage) == 1
    for w in (0, 1):
        assert both_fwd(stage, ref, [frame(1, w, 0, 11, [1] * 4)], [w])[0] == [(6, 0)]
    assert _held(stage) == 0  # ... until both members passed in round 11: they had round 10's
    # the collision lasted one round: slot 1's round 12 is summed in the switch
    assert both(stage, ref, [frame(1, 0, 1, 12, [4] * 4)], [0])[0] == [(PORT_HELD, 0)]
    _, out = both(stage, ref, [frame(1, 1, 1, 12, [5] * 4)], [1])
    assert all(values_of(f).tolist() == [9] * 4 for _, f in out)
    c = stage.counters()
    assert (c["pool_claims"], c["pool_collisions"], c["fallback_forwarded"]) == (2, 3, 7)
    assert c["jobs"]["1"]["slots_at_host"] == 2  # both slots' round 11 went to the host


def _shared_tree_pair(entries=1):
    """A leaf switch (job 1: 2 members, 2 slots) in shared mode on a pool of ``entries``
    entries, its host fallback FB2 behind port 6, its parent behind port 7 (UPLINK)."""
    kj, rj = _jobs(True, {1: (2, 2, 10)}), _jobs(False, {1: (2, 2, 10)})
    kj[1].update(mode="shared", fallback=dict(FB2, egress=PORTS[6]),
                 parent=dict(PARENT, egress=PORTS[UPLINK]))
    rj[1].update(mode="shared", fallback=dict(FB2, egress=6), parent=dict(PARENT, egress=UPLINK))
    stage = AggregateStage(ports=PORTS, pool_slots=8, max_elems=16, jobs=kj,
                           pool_bytes=entries * 4 * 256, memory_bytes=64 << 10)
    ref = AggregateReference(DEFAULT_AGG_MAC, DEFAULT_AGG_IP, rj, max_elems=16,
                             pool_entries=entries, pool_lanes=256)
    return stage, ref


FB2_SRC = (bytes.fromhex("0254420f0002"), bytes([10, 253, 0, 2]), 41001)


def test_a_tree_node_relays_the_host_rounds_between_its_fallback_and_the_tree():
    """F3: a leaf whose pool is held leaves round 10 of slot 1 to its host fallback; the
    fallback's partial sum goes up as the leaf's own (its identity, its
    member id at the parent), the parent's RESULT of that round back to the fallback; a RESULT
    the fallback sends for a member (a fallback of switches) goes down as the leaf's. Packets
    with the fallback's address from another port, or for a round the leaf holds itself, or
    from the fallback of a round the leaf never left to it, are not relayed."""
    stage, ref = _shared_tree_pair()
    both(stage, ref, [frame(1, 0, 0, 10, [1] * 4)], [0])  # slot 0 holds the only entry
    for w in (0, 1):
        assert both_fwd(stage, ref, [frame(1, w, 1, 10, [w + 1] * 4)], [w])[0] == [(6, 0)]
    up = frame(1, 1, 1, 10, [3] * 4, src=FB2_SRC)
    dec, res, fwd = both_fwd(stage, ref, [up], [6])
    assert dec == [(UPLINK, 0)] and res == []
    h = unpack_header(fwd[0], HEADER_OFFSET)
    assert (h["msg_type"], h["worker_id"], h["seq"]) == (MsgType.DATA, PARENT["index"], 10)
    assert fwd[0][:6] == PARENT_MAC and fwd[0][6:12] == AGG_MAC and fwd[0][26:30] == AGG_IP
    assert fwd[0][30:34] == PARENT_IP and values_of(fwd[0]).tolist() == [3] * 4
    # the parent's RESULT of the host's round goes to the fallback, from the leaf
    dec, res, fwd = both_fwd(stage, ref, [parent_result(10, [30] * 4, slot=1)], [UPLINK])
    assert dec == [(6, 0)] and res == [] and fwd[0][30:34] == bytes([10, 253, 0, 2])
    assert fwd[0][26:30] == AGG_IP and fwd[0][36:38] == (41001).to_bytes(2, "big")
    # a RESULT the fallback addresses to member 1 through the leaf
    down = frame(1, 1, 1, 10, [30] * 4, MsgType.RESULT, src=FB2_SRC)
    dec, _, fwd = both_fwd(stage, ref, [down], [6])
    assert dec == [(1, 0)] and fwd[0][30:34] == bytes([10, 1, 0, 2]) and fwd[0][26:30] == AGG_IP
    assert fwd[0][36:38] == (5001).to_bytes(2, "big")
    # not relayed: from another port (not a member either), a round the leaf holds, a round
    # the fallback never had
    assert both(stage, ref, [up], [2])[0] == [(PORT_DROP, R.NOT_MEMBER)]
    assert both(stage, ref, [frame(1, 9, 0, 10, [3] * 4, src=FB2_SRC)], [6])[0] == \
        [(PORT_DROP, R.STALE)]
    assert both(stage, ref, [frame(1, 9, 1, 12, [3] * 4, src=FB2_SRC)], [6])[0] == \
        [(PORT_DROP, R.STALE)]
    assert both(stage, ref, [frame(1, 5, 1, 10, [3] * 4, MsgType.RESULT, src=FB2_SRC)],
                [6])[0] == [(PORT_DROP, R.BAD_WORKER)]
    assert stage.counters()["fallback_relayed"] == 3


def test_released_entry_reclaimed_by_another_job_never_mixes_their_sums():
    """Job 1's round 10 leaves its sum in the one entry; job 2's round 21 reclaims the entry
    once job 1's members all sent round 11; a retransmission of job 1's round 10 is then STALE
    (never answered with, nor added into, job 2's round), and job 2's sum is exactly its own."""
    stage, ref = _shared_pair(entries=1, jobs={1: (2, 1, 10), 2: (2, 1, 20)})
    _, out = both(stage, ref, [frame(1, w, 0, 10, [1000] * 4) for w in (0, 1)], [0, 1])
    assert len(out) == 2
    for w in (0, 1):  # job 2's round 20 and job 1's round 11: the entry is held
        assert both_fwd(stage, ref, [frame(2, w, 0, 20, [7] * 4)], [w])[0] == [(6, 0)]
    for w in (0, 1):
        assert both_fwd(stage, ref, [frame(1, w, 0, 11, [7] * 4)], [w])[0] == [(6, 0)]
    assert both(stage, ref, [frame(2, 0, 0, 21, [100] * 4)], [0])[0] == [(PORT_HELD, 0)]
    assert stage.regs.pool_owner[0] >= 0 and _held(stage) == 1  # job 2's round holds it
    assert both(stage, ref, [frame(1, 1, 0, 10, [1000] * 4, MsgType.RETRANSMIT)], [1])[0] == \
        [(PORT_DROP, R.STALE)]
    assert both_fwd(stage, ref, [frame(1, 1, 0, 11, [7] * 4, MsgType.RETRANSMIT)], [1])[0] == \
        [(6, 0)]
    _, out = both(stage, ref, [frame(2, 1, 0, 21, [200] * 4)], [1])
    assert len(out) == 2 and all(values_of(f).tolist() == [300] * 4 for _, f in out)
    assert all(unpack_header(f, HEADER_OFFSET)["job_id"] == 2 for _, f in out)


def test_host_fallback_takes_the_rounds_its_switch_sent_even_when_they_skip_ahead():
    """A job in ``fallback`` mode (a host fallback) sees only the rounds its switch could not
    hold: a later round of a set starts once that set's round is complete, whatever came
    between; a round still open there cannot be overtaken, and older rounds are STALE."""
    job = {1: (2, 2, 10)}
    kj, rj = _jobs(True, job), _jobs(False, job)
    kj[1]["mode"] = rj[1]["mode"] = "fallback"
    stage = AggregateStage(ports=PORTS, pool_slots=8, max_elems=16, jobs=kj)
    ref = AggregateReference(DEFAULT_AGG_MAC, DEFAULT_AGG_IP, rj, max_elems=16)
    _, out = both(stage, ref, [frame(1, w, 0, 10, [w + 1] * 4) for w in (0, 1)], [0, 1])
    assert all(values_of(f).tolist() == [3] * 4 for _, f in out)
    # rounds 11..15 were summed in the switch; round 16 (set 0) comes here
    assert both(stage, ref, [frame(1, 0, 0, 16, [5] * 4)], [0])[0] == [(PORT_HELD, 0)]
    assert both(stage, ref, [frame(1, 1, 0, 18, [5] * 4)], [1])[0] == [(PORT_DROP, R.BAD_SEQ)]
    assert both(stage, ref, [frame(1, 1, 0, 12, [5] * 4)], [1])[0] == [(PORT_DROP, R.STALE)]
    _, out = both(stage, ref, [frame(1, 1, 0, 16, [6] * 4)], [1])
    assert all(values_of(f).tolist() == [11] * 4 for _, f in out)
    _, ans = both(stage, ref, [frame(1, 0, 0, 16, [5] * 4, MsgType.RETRANSMIT)], [0])
    assert ans == [out[0]]  # S1 as on the switch
    assert stage.counters()["jobs"]["1"]["mode"] == "fallback"


def _value(job, w, slot, seq):
    return (job * 1000003 + w * 7919 + slot * 104729 + seq * 31) % 100000


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 2]), st.integers(0, 2), st.integers(0, 1),
                          st.sampled_from(["next"] * 6 + ["retx", "late", "late2"])),
                min_size=1, max_size=120),
       st.integers(1, 3), st.integers(1, 6))
def test_two_jobs_time_sharing_a_pool_agree_with_the_twin_and_never_mix(events, entries,
                                                                       burst):
    """Two jobs' honest members (3 and 2) move their slots' rounds on as results come back
    (from the switch, or from the host once every member's contribution was forwarded there),
    retransmit, and send late packets, in random order, on a pool of 1-3 entries: kernel and
    twin take the same decisions and emit the same bytes, every RESULT is its own job's exact
    sum of that round, and the pool never holds more than it has."""
    jobs = {1: (3, 2, 10), 2: (2, 2, (1 << 32) - 1)}
    stage, ref = _shared_pair(entries=entries, jobs=jobs)
    cur = {(j, w, k): (jobs[j][2], False) for j in jobs for w in range(jobs[j][0])
           for k in range(2)}  # -> (round, sent)
    done: set = set()
    forwarded: dict = {}
    pending, ports, meta = [], [], []

    def flush():
        if not pending:
            return
        dec, res, _ = both_fwd(stage, ref, pending, ports)
        for (j, w, k, r), (d, _) in zip(meta, dec, strict=True):
            if d >= 0:
                forwarded.setdefault((j, k, r), set()).add(w)
                if len(forwarded[(j, k, r)]) == jobs[j][0]:
                    done.add((j, k, r))
        for _, f in res:
            h = unpack_header(f, HEADER_OFFSET)
            j, k, r = int(h["job_id"]), int(h["slot"]), int(h["seq"])
            want = sum(_value(j, w, k, r) for w in range(jobs[j][0]))
            assert values_of(f).tolist() == [want] * 4
            done.add((j, k, r))
        pending.clear(), ports.clear(), meta.clear()
        assert _held(stage) <= entries

    for j, w, k, kind in events:
        w %= jobs[j][0]
        r, sent = cur[(j, w, k)]
        mt = MsgType.RETRANSMIT
        if kind == "next":
            if sent and (j, k, r) in done:
                r, sent = (r + 1) & 0xFFFFFFFF, False
            if sent:
                continue
            cur[(j, w, k)] = (r, True)
            mt = MsgType.DATA
        elif kind.startswith("late"):
            r = (r - (2 if kind == "late2" else 1)) & 0xFFFFFFFF
        elif not sent:
            continue
        pending.append(frame(j, w, k, r, [_value(j, w, k, r)] * 4, mt))
        ports.append(w)
        meta.append((j, w, k, r))
        if len(pending) >= burst:
            flush()
    flush()


@pytest.mark.parametrize("layout", ["tree", "shared", "shared_tree"])
@pytest.mark.parametrize("seed", range(3))
def test_trees_and_shared_pool_exact_under_impairments_and_twin_agrees(layout, seed):
    """A two-level tree (leaves of 3 workers), a shared pool too small for the job (host
    fallback for the rest), or that tree with every switch on a pool too small (each level's
    host fallback for the rest, its packets relayed by its switch), over a channel that loses,
    duplicates and reorders on every hop: exact sums, twice in a row, and the kernels and the
    twins take the same decisions."""
    kw = dict(n=7, W=4, count=2500, seed=seed, loss=0.08, dup=0.08, reorder=0.3, reps=2)
    kw.update({"tree": dict(fanout=3), "shared": dict(pool=4, pool_taken=(0, 1)),
               "shared_tree": dict(fanout=3, pool=2, pool_taken=(0,))}[layout])
    a, b = Sim(**kw), Sim(**kw, kernels=ik_ref, switch="reference")
    pa, pb = a.run(), b.run()
    want = a.expected_qsum(pa[0])
    assert all(np.array_equal(p.qsum, want) for p in pa)
    assert all(np.array_equal(x.qsum, y.qsum) for x, y in zip(pa, pb, strict=True))
    assert a.stats == b.stats or {k: v for k, v in a.stats.items() if k != "switch_drops"} == \
        {k: v for k, v in b.stats.items() if k != "switch_drops"}
    if layout != "tree":
        assert a.stats["fallback"] > 0
    if layout == "shared_tree":  # partial sums and results of host rounds crossed the tree
        assert a.stats["relayed"] > 0
