"""The fallback server kept started ahead: handed over, replaced, never handed over dead, and
gone with its block (none outlives it). That a handed-over server serves a job's fallbacks is
on Mininet, where a co-operation trace moves a running job to the shared pools
(``tests/provider/test_provider_cooperation.py``); here no process waits for its kernel."""

from __future__ import annotations

from testbed.collectives.runner import SpareFallbackServer


def test_a_spare_fallback_server_is_handed_over_replaced_and_stopped():
    with SpareFallbackServer() as spare:
        first = spare.proc
        got = spare.take()
        assert got is first and got.poll() is None
        second = spare.proc
        assert second is not None and second is not first and second.poll() is None
        got.kill()  # the caller's now: host_fallbacks would send it its order
        got.wait()
        # one that died is not handed over: a fresh process is, and another waits
        second.kill()
        second.wait()
        fresh = spare.take()
        assert fresh is not second and fresh.poll() is None
        third = spare.proc
        assert third is not None and third.poll() is None
        fresh.kill()
        fresh.wait()
    assert spare.proc is None and third.poll() is not None  # gone with the block
    # outside its block it keeps nothing ahead: a fresh process each time
    got = spare.take()
    assert spare.proc is None and got.poll() is None
    got.kill()
    got.wait()
