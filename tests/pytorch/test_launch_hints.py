"""What the launcher derives of a running job's hints from its trace (no network)."""

from __future__ import annotations

import pytest

from testbed.launch import derive_hints


def _rows(pattern: list[tuple[str, int, float]], iterations: int, head=(), t_iter=0.5):
    """Rank 0's trace rows: ``head`` calls once, then ``pattern`` (op, bytes, seconds) every
    ``t_iter`` seconds."""
    rows, t = [], 0.0
    for op, nbytes, dt in head:
        rows.append({"op": op, "bytes": nbytes, "start_s": t, "end_s": t + dt})
        t += dt
    for _ in range(iterations):
        start = t
        for op, nbytes, dt in pattern:
            rows.append({"op": op, "bytes": nbytes, "start_s": t, "end_s": t + dt})
            t += dt
        t = start + t_iter
    return rows


DDP = [("allreduce", 1 << 20, 0.05), ("allreduce", 4 << 20, 0.12), ("send to 1", 64, 0.0),
       ("allreduce", 256, 0.01)]


def test_a_ddp_step_is_found_after_its_buckets_repeat_three_times():
    head = [("broadcast", 9000, 0.02), ("allreduce", 5 << 20, 0.3)]  # DDP's first step
    assert derive_hints(_rows(DDP, 2, head), 1.0) is None
    hints = derive_hints(_rows(DDP, 3, head), 1.0)
    assert hints["collective_bytes"] == (1 << 20) + (4 << 20) + 256
    assert hints["iteration_s"] == pytest.approx(0.5)
    assert hints["compute_s"] == pytest.approx(0.5 - 0.18)


def test_a_dilated_run_gives_undilated_seconds_and_repeats_may_be_asked_for():
    hints = derive_hints(_rows(DDP, 5), 4.0, repeats=5)
    assert hints["iteration_s"] == pytest.approx(0.125)
    assert derive_hints(_rows(DDP, 4), 4.0, repeats=5) is None


@pytest.mark.parametrize("rows", [
    [],
    _rows([("all_to_all", 4096, 0.01)], 6),  # no allreduce: nothing the provider plans
    # sizes that never repeat (a warm-up sweep)
    [{"op": "allreduce", "bytes": 4 << k, "start_s": k, "end_s": k + 0.1} for k in range(9)],
])
def test_no_iteration_no_hints(rows):
    assert derive_hints(rows, 1.0) is None


def test_more_ranks_than_one_switch_takes_aggregate_on_a_tree():
    """``testbed launch --algo ina`` of more than 32 ranks gets placement tree 'auto' (it has
    no option to give one, and one switch takes at most 32 members), which then validates;
    32 ranks, a named tree and a host algorithm are left as they are."""
    from testbed.launch import _tree_for_many, backend_settings

    ina = backend_settings("ina", None, None, False, 1)
    with pytest.raises(ValueError, match="tree='auto'"):
        ina.validate(34)
    many = _tree_for_many(ina, 34)
    assert many.placement == {"tree": "auto"} and ina.placement == {}
    many.validate(34)
    assert _tree_for_many(ina, 32) is ina
    named = backend_settings("ina", None, None, False, 1, placement={"tree": ["tbsp1"]})
    assert _tree_for_many(named, 34) is named
    ring = backend_settings("ring", None, None, False, 1)
    assert _tree_for_many(ring, 34) is ring


def test_tree_names_the_aggregation_tree_of_an_offloaded_job(tmp_path):
    """``testbed launch --tree``: auto, single or switch names become the backend's placement
    (and so the tree the INA job is registered on); for a host algorithm, plain gloo or a
    provider's plan it is refused before anything is built."""
    from testbed.launch import _tree_placement, backend_settings, launch

    assert _tree_placement(None, "ina") is None
    assert _tree_placement("auto", "ina") == {"tree": "auto"}
    assert _tree_placement("single", "nic") == {"tree": "single"}
    assert _tree_placement("tbl1,tbsp1", "ina") == {"tree": ["tbl1", "tbsp1"]}
    named = backend_settings("ina", None, None, False, 1,
                             placement=_tree_placement("tbl1,tbsp1", "ina"))
    assert named.placement == {"tree": ["tbl1", "tbsp1"]}
    script = tmp_path / "noop.py"
    script.write_text("print('never run')\n")
    for algo, tree, says in (("ring", "auto", "not ring"), (None, "auto", "not plain gloo"),
                             ("ina", ",", "takes auto, single or switch names"),
                             ("auto", "auto", "lets the provider place the job")):
        with pytest.raises(ValueError, match=says):
            launch(script, algo=algo, tree=tree, hosts=2)
