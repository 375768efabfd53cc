"""Hostile clients at a real engine's control channel (issue 35: bad input at every boundary).

One switch engine (``programmable_star``: h1 -- tbs1 -- h2, program ``forward``) gets random
bytes, garbled JSON, JSON of the wrong types, over-long requests, half-written requests, slow
and silent clients, clients that never read their answers and a crowd of 200 connections at
once. After every attack the engine must still run, answer (``counters`` sane) and forward
(h1 pings h2), every complete request must have been answered (an error that says why when
refused), and its descriptors and memory must be back near where they started.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from testbed.datapath.control import (
    MAX_CLIENTS,
    MAX_REQUEST_BYTES,
    ControlError,
    DatapathClient,
    _sockaddr,
    control_address,
)

pytestmark = pytest.mark.mininet

NODE = "tbs1"
PORTS = {"tbs1-eth1", "tbs1-eth2"}
#: descriptors the engine may hold above its baseline once the attackers are gone
FD_SLACK = 3
#: resident memory the engine may have gained after an attack (generous: the bound that
#: matters is "not the attack's size times the connections")
RSS_SLACK_KB = 96 * 1024
#: the longest a well-behaved request may take while the engine is under attack (the old
#: server blocked its loop 2 s per client that did not read its answers)
PROMPT_S = 1.5
FUZZ = settings(max_examples=100, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.fixture(scope="module")
def eng():
    """The running engine of tbs1 and a well-behaved client connected before any attack.
    Afterwards (the network is down, the lock still held) nothing of it may be left."""
    from testbed.cleanup import leftovers
    from testbed.netlock import emulation_lock
    from testbed.testing import programmable_star

    with emulation_lock():
        with programmable_star(2, programs=[("forward", {})]) as (_net, (h1, h2), s1):
            pid = s1.engine_pid()
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                assert b"testbed.datapath.engine" in fh.read()
            good = s1.client()
            e = SimpleNamespace(s1=s1, h1=h1, h2=h2, pid=pid, good=good,
                                address=control_address(NODE), rx=0)
            assert "0% packet loss" in h1.cmd("ping -c 2 -i 0.2", h2.IP())
            _sane(e, good.counters())
            e.fds0, e.rss0 = _fd_count(pid), _rss_kb(pid)
            e.coalesce0 = good.config()["coalesce_us"]
            try:
                yield e
            finally:
                good.close()
        left = leftovers()
        assert not any(left.values()), f"left behind: {left}"


def _sane(e, c: dict) -> None:
    assert c["node"] == NODE and set(c["ports"]) == PORTS, c
    for p in c["ports"].values():
        assert all(isinstance(p[k], int) and p[k] >= 0
                   for k in ("rx_packets", "rx_bytes", "tx_packets", "tx_bytes")), p
    rx = sum(p["rx_packets"] for p in c["ports"].values())
    assert rx >= e.rx, "counters went backwards"
    e.rx = rx
    assert c["uptime_s"] > 0 and c["stage_errors"] == {}, c


def _alive(e) -> None:
    assert e.s1.engine.poll() is None, f"engine exited:\n{e.s1._log_tail()}"


def _healthy(e, after: str) -> None:
    """Alive, answers (the old client and a new one), forwards, and gave back its
    descriptors and memory."""
    _alive(e)
    deadline = time.monotonic() + 5  # it closes a gone client's descriptor on its next round
    while _fd_count(e.pid) > e.fds0 + FD_SLACK and time.monotonic() < deadline:
        time.sleep(0.05)
    fds = _fd_count(e.pid)
    assert fds <= e.fds0 + FD_SLACK, f"after {after}: {fds} descriptors, {e.fds0} before"
    rss = _rss_kb(e.pid)
    assert rss <= e.rss0 + RSS_SLACK_KB, f"after {after}: RSS {rss} kB, {e.rss0} kB before"
    _sane(e, e.good.counters())
    with DatapathClient(e.address) as fresh:
        _sane(e, fresh.counters())
    assert "0% packet loss" in e.h1.cmd("ping -c 1 -W 2", e.h2.IP()), f"after {after}"
    _alive(e)


def _raw(e, timeout: float = 5.0) -> socket.socket:
    """A plain connection to the engine (retried while its queue of connections not yet
    accepted is full, as :class:`DatapathClient` does)."""
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(_sockaddr(e.address))
            return s
        except BlockingIOError:
            s.close()
            assert time.monotonic() < deadline, "the engine accepted no connection"
            time.sleep(0.01)


def _read_answers(s: socket.socket, n: int) -> list[dict]:
    """The next ``n`` answer lines (fewer only if the engine closed the connection)."""
    buf = b""
    while buf.count(b"\n") < n:
        chunk = s.recv(1 << 16)
        if not chunk:
            break
        buf += chunk
    return [json.loads(line) for line in buf.split(b"\n")[:n] if line]


def _closed(s: socket.socket) -> bool:
    """Whether the engine closed ``s`` (a reset: it closed with our request unread)."""
    try:
        return s.recv(1 << 16) == b""
    except ConnectionResetError:
        return True


def _exchange(e, data: bytes) -> list[dict]:
    """Send ``data`` on a new connection; one answer per complete line, each well formed."""
    with _raw(e) as s:
        s.sendall(data)
        n = data.count(b"\n")
        answers = _read_answers(s, n)
    assert len(answers) == n, (data[:200], answers[:5])
    for a in answers:
        assert isinstance(a, dict) and isinstance(a.get("ok"), bool), a
        if not a["ok"]:
            assert isinstance(a.get("error"), str) and len(a["error"]) > 3, a
    return answers


# --- 1. random bytes, garbled JSON, JSON of the wrong types ------------------------------------

@FUZZ
@given(data=st.binary(max_size=4096))
def test_random_bytes_are_refused(eng, data):
    assume(b"stop" not in data)
    for a in _exchange(eng, data + b"\n"):
        assert a["ok"] is False
    _alive(eng)


BASE = [b'{"cmd": "counters"}', b'{"cmd": "config"}', b'{"cmd": "ping"}',
        b'{"cmd": "trace"}', b'{"cmd": "coalesce", "us": 50}',
        b'{"cmd": "configure", "stage": "forward", "settings": {"l2": {}}}',
        b'{"cmd": "reset_job", "job_id": 1}', b'{"cmd": "trace", "count": 3}']
ALPHABET = b'{}[]":,\\ \n\t0123456789.-eE+abcdeflnrstu\x00\x7f\xc3\xff'


@FUZZ
@given(st.data())
def test_garbled_json_is_answered(eng, data):
    line = bytearray(data.draw(st.sampled_from(BASE)))
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, len(line)))
        op = data.draw(st.sampled_from(["insert", "delete", "replace", "duplicate"]))
        ch = bytes([data.draw(st.sampled_from(ALPHABET))])
        if op == "insert":
            line[i:i] = ch
        elif op == "delete":
            del line[i:i + 1]
        elif op == "replace":
            line[i:i + 1] = ch
        else:
            line[i:i] = line[i:i + data.draw(st.integers(1, 20))]
    assume(b"stop" not in line)
    _exchange(eng, bytes(line) + b"\n")
    _alive(eng)


_scalars = (st.none() | st.booleans() | st.integers() | st.floats()
            | st.text(max_size=12))
JSON = st.recursive(_scalars, lambda ch: st.lists(ch, max_size=4)
                    | st.dictionaries(st.text(max_size=8), ch, max_size=4), max_leaves=12)
COMMANDS = ["counters", "config", "ping", "configure", "coalesce", "reset_job", "trace"]
ARGS = ["stage", "settings", "us", "job_id", "count"]
#: forward's switches take any value (bool(x)): a fuzzed false would turn forwarding off
SWITCHES = {"learn", "flood", "validate"}


def _request(cmd, args: dict, settings_: dict | None):
    req = {**args, "cmd": cmd}
    if settings_ is not None:
        req["settings"] = settings_
    return req


REQUESTS = st.one_of(
    JSON.filter(lambda v: not isinstance(v, dict)),  # not an object at all
    st.builds(_request, st.sampled_from(COMMANDS) | JSON,
              st.dictionaries(st.sampled_from(ARGS) | st.text(max_size=8), JSON, max_size=4),
              st.none() | st.dictionaries(st.sampled_from(["l2", "l3", "bogus"])
                                          | st.text(max_size=8), JSON, max_size=3)))


@FUZZ
@given(REQUESTS)
def test_json_of_wrong_types_is_answered(eng, req):
    if isinstance(req, dict):
        assume(req.get("cmd") != "stop")
        assume(not (isinstance(req.get("settings"), dict) and SWITCHES & set(req["settings"])))
    _exchange(eng, json.dumps(req).encode() + b"\n")
    _alive(eng)


#: (request line, what the error must say)
REFUSED = [
    (b"[]", "request must be a JSON object"),
    (b'[{"cmd": "counters"}]', "request must be a JSON object"),
    (b"42", "request must be a JSON object"),
    (b'"counters"', "request must be a JSON object"),
    (b"null", "request must be a JSON object"),
    (b"", "JSONDecodeError"),
    (b"   ", "JSONDecodeError"),
    (b'{"cmd": "counters"', "JSONDecodeError"),
    (b'{"cmd": "counters"}}', "Extra data"),
    (b"{'cmd': 'counters'}", "JSONDecodeError"),
    (b'{"cmd": "\xc3\x28"}', "Error"),  # not UTF-8
    (b"\xff\xfe\x00\x01", "Error"),
    (b"[" * 100_000, "recursion"),
    (b'{"cmd": ' + b"9" * 5000 + b"}", "limit"),
    (b"{}", "unknown command None"),
    (b'{"cmd": "nosuch"}', "unknown command 'nosuch'"),
    (b'{"cmd": 7}', "unknown command 7"),
    (b'{"cmd": ["counters"]}', "unknown command ['counters']"),
    (b'{"cmd": {"cmd": "counters"}}', "unknown command"),
    (b'{"cmd": null}', "unknown command None"),
    (b'{"cmd": "configure"}', "no stage 'None'"),
    (b'{"cmd": "configure", "stage": ["forward"]}', "no stage"),
    (b'{"cmd": "configure", "stage": "forward", "settings": [1, 2]}',
     "'settings' must be an object"),
    (b'{"cmd": "configure", "stage": "forward", "settings": "l2"}',
     "'settings' must be an object"),
    (b'{"cmd": "configure", "stage": "forward", "settings": {"colour": "red"}}',
     "unknown settings"),
    (b'{"cmd": "configure", "stage": "forward", "settings": {"l2": 5}}', "Error"),
    (b'{"cmd": "configure", "stage": "forward", "settings": {"l2": {"not a mac": 1}}}',
     "bad MAC address"),
    (b'{"cmd": "configure", "stage": "forward", "settings": {"l3": {"10.0.0.300": 1}}}',
     "bad IPv4 address"),
    (b'{"cmd": "coalesce"}', "coalesce_us must be a number"),
    (b'{"cmd": "coalesce", "us": "fast"}', "coalesce_us must be a number"),
    (b'{"cmd": "coalesce", "us": 1e999}', "coalesce_us must be a number"),
    (b'{"cmd": "coalesce", "us": NaN}', "coalesce_us must be a number"),
    (b'{"cmd": "coalesce", "us": [50]}', "coalesce_us must be a number"),
    (b'{"cmd": "coalesce", "us": true}', "coalesce_us must be a number"),
    (b'{"cmd": "reset_job", "job_id": "x"}', "no aggregate stage"),
    (b'{"cmd": "trace", "count": "ten"}', "count must be an integer"),
    (b'{"cmd": "trace", "count": -1}', "count must be an integer"),
    (b'{"cmd": "trace", "count": 1e3}', "count must be an integer"),
    (b'{"cmd": "trace", "count": 100000000000000000000000}', "count must be an integer"),
    (b'{"cmd": "trace", "count": true}', "count must be an integer"),
    (b'{"cmd": "trace", "count": null}', "count must be an integer"),
]


def test_wrong_requests_are_refused_saying_why(eng):
    """Every line of one pipelined write is answered, in order, with an error that says why;
    then the fuzzing above left the engine healthy."""
    answers = _exchange(eng, b"".join(line + b"\n" for line, _ in REFUSED))
    for (line, why), a in zip(REFUSED, answers, strict=True):
        assert a["ok"] is False and why in a["error"], (line[:80], a)
    eng.good.set_coalesce(eng.coalesce0)  # the fuzzing may have set another (a valid request)
    eng.good.trace(0)
    _healthy(eng, "fuzzed requests")


# --- 2. over-long requests ---------------------------------------------------------------------

@pytest.mark.parametrize("tail", [b"", b"\n"], ids=["no-newline", "newline"])
def test_oversized_request_is_refused_and_its_connection_closed(eng, tail):
    with _raw(eng, timeout=20) as s:
        try:
            s.sendall(b"x" * (3 << 20) + tail)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed under the sender: the refusal still waits to be read
        answers = _read_answers(s, 1)
        assert len(answers) == 1 and answers[0]["ok"] is False, answers
        assert f"longer than {MAX_REQUEST_BYTES} bytes" in answers[0]["error"]
        assert _closed(s)
    # a long but legal request is still served
    big = b'{"cmd": "counters"' + b" " * (MAX_REQUEST_BYTES - 100) + b"}\n"
    a, = _exchange(eng, big)
    assert a["ok"] is True
    _sane(eng, a["result"])
    _healthy(eng, "an oversized request")


# --- 3. half-written, slow, silent and deaf clients ----------------------------------------------

def test_half_written_requests_then_gone(eng):
    partials = [b'{"cmd": "coun', b"{", b"\xff" * 100, b'{"cmd": "counters"}',
                b"x" * 200_000, b'{"cmd": "counters"}\n{"cmd": "con']
    for i in range(60):
        s = _raw(eng)
        s.sendall(partials[i % len(partials)])
        if i % 3 == 0:
            s.shutdown(socket.SHUT_WR)  # said it is done: the complete lines are answered
            got = _read_answers(s, 2)
            assert len(got) == partials[i % len(partials)].count(b"\n"), got
        s.close()
    # a request finished after a pause is served as if sent at once
    with _raw(eng) as s:
        s.sendall(b'{"cmd": "coun')
        time.sleep(0.3)
        s.sendall(b'ters"}\n')
        a, = _read_answers(s, 1)
        _sane(eng, a["result"])
    _healthy(eng, "half-written requests")


def _prompt(e, rounds: int) -> float:
    """The slowest of ``rounds`` well-behaved requests (each checked)."""
    worst = 0.0
    for _ in range(rounds):
        t0 = time.monotonic()
        _sane(e, e.good.counters())
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.05)
    return worst


def test_slow_silent_and_deaf_clients_block_no_one(eng):
    """A client that never sends, one that sends a byte every 30 ms, and clients that send
    many requests but never read the answers: the others are answered promptly meanwhile."""
    silent = _raw(eng)
    slow_answer = []

    def slow():
        with _raw(eng, timeout=30) as s:
            for b in b'{"cmd": "counters"}\n':
                s.sendall(bytes([b]))
                time.sleep(0.03)
            slow_answer.extend(_read_answers(s, 1))

    t = threading.Thread(target=slow)
    t.start()
    deaf = []
    try:
        for _ in range(5):
            s = _raw(eng)
            s.setblocking(False)
            try:
                while True:  # as much as the socket takes; the answers pile up unread
                    s.send(b'{"cmd": "counters"}\n' * 512)
            except BlockingIOError:
                pass
            deaf.append(s)
        worst = _prompt(eng, 20)
        t.join(30)
        assert not t.is_alive()
        assert worst < PROMPT_S, f"a request took {worst:.2f} s beside deaf and slow clients"
        assert len(slow_answer) == 1 and slow_answer[0]["ok"] is True, slow_answer
        _sane(eng, slow_answer[0]["result"])
        assert _prompt(eng, 3) < PROMPT_S  # the silent one is still connected
    finally:
        t.join(30)
        silent.close()
        for s in deaf:
            s.close()
    _healthy(eng, "slow, silent and deaf clients")


# --- 4. a crowd ----------------------------------------------------------------------------------

def test_200_clients_at_once_some_hostile(eng):
    """200 connections (well-behaved, garbage, silent, half-written, deaf) while a client
    connected before keeps getting correct answers promptly: beyond MAX_CLIENTS they are
    refused with an error that says so; the others are served."""
    stop = threading.Event()
    worst, errors = [0.0], []

    def steady():
        with DatapathClient(eng.address) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    cnt = c.counters()
                    assert cnt["node"] == NODE and set(cnt["ports"]) == PORTS
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(repr(exc))
                worst[0] = max(worst[0], time.monotonic() - t0)
                time.sleep(0.02)

    t = threading.Thread(target=steady)
    t.start()
    time.sleep(0.2)
    socks, kinds = [], ["ping", "garbage", "silent", "half", "deaf"]
    sends = {"ping": b'{"cmd": "ping"}\n', "garbage": b"{garbage\n",
             "silent": b"", "half": b'{"cmd": "coun',
             "deaf": b'{"cmd": "counters"}\n' * 200}
    try:
        for i in range(200):
            kind = kinds[i % len(kinds)]
            s = _raw(eng)
            try:
                s.sendall(sends[kind])
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused and closed already
            socks.append((kind, s))
        time.sleep(0.5)
        refused = served = 0
        for kind, s in socks:
            if kind == "deaf":
                continue
            s.settimeout(3 if kind in ("ping", "garbage") else 0.01)
            try:
                got = _read_answers(s, 1)
            except TimeoutError:
                got = []
            if got and "too many control connections" in got[0].get("error", ""):
                refused += 1
                assert _closed(s)
            elif kind == "ping":
                assert got == [{"ok": True, "result": "pong"}]
                served += 1
            elif kind == "garbage":
                assert got and got[0]["ok"] is False and "JSONDecodeError" in got[0]["error"]
                served += 1
            else:
                assert got == [], (kind, got)  # waiting for the rest of its request
        # the engine is full: the client library reports the refusal as it was given
        with pytest.raises(ControlError, match="too many control connections"), \
                DatapathClient(eng.address) as extra:
            extra.counters()
    finally:
        stop.set()
        t.join(30)
        for _, s in socks:
            s.close()
    assert errors == [], errors[:5]
    assert worst[0] < PROMPT_S, f"a request took {worst[0]:.2f} s during the crowd"
    assert served > 0
    # the engine held MAX_CLIENTS connections (the two steady clients among them): the rest
    # were refused, four in five of them read here (the deaf are not)
    assert refused >= (200 - MAX_CLIENTS) * 4 // 5 - 3, refused
    _healthy(eng, "200 clients at once")
