"""The fallback server kept started ahead: handed over ready, replaced, never handed over
dead, and gone with its block (none outlives it)."""

from __future__ import annotations

import json

from testbed.collectives.runner import SpareFallbackServer, _line_within


def test_a_spare_fallback_server_is_handed_over_replaced_and_stopped():
    with SpareFallbackServer() as spare:
        first = spare.proc
        got = spare.take()
        assert got is first and spare.proc is not None and spare.proc is not first
        second = spare.proc
        # the one handed over serves an order as a freshly started one would: an order
        # without fallbacks is ready at once, and it reports counters when its input ends
        got.stdin.write(json.dumps({"job_id": 7, "timeout_s": 5, "fallbacks": []}) + "\n")
        got.stdin.flush()
        assert _line_within(got, 300) == {"type": "ready"}
        out, _ = got.communicate(timeout=60)
        assert got.returncode == 0 and json.loads(out.splitlines()[-1])["type"] == "counters"
        assert second.poll() is None  # the next spare waits for its order
    assert spare.proc is None and second.poll() is not None  # gone with the block

    # a spare that died is not handed over: a fresh process is
    spare = SpareFallbackServer()
    with spare:
        spare.proc.kill()
        spare.proc.wait()
        dead = spare.proc
        got = spare.take()
        assert got is not dead and got.poll() is None
        got.kill()
        got.wait()
    # outside its block it keeps nothing ahead: a fresh process each time
    got = spare.take()
    assert spare.proc is None and got.poll() is None
    got.kill()
    got.wait()
