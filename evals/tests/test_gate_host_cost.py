"""``evals/gate_host_cost.py``: the gate's host time per step, by call (CPU)."""

import gate_host_cost


def test_every_call_of_a_step_is_timed():
    """Each of the gate's three per-step calls ran and was timed after the warm-up."""
    spent = gate_host_cost.host_microseconds(2, steps=40, warmup=40)
    assert set(spent) == set(gate_host_cost.CALLS)
    assert all(us > 0 for us in spent.values()), spent


def test_baseline_revision_is_timed_beside_the_working_tree(capsys):
    """``--baseline REV``: the package as committed at REV, in child processes beside the
    working tree's, and the ratio of their totals."""
    gate_host_cost.main(["--baseline", "HEAD", "--repeats", "1", "--steps", "20",
                         "--batches", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("command: python evals/gate_host_cost.py --baseline HEAD")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines
            if line.startswith("| 1 |")]
    assert [r[1] for r in rows] == ["HEAD", "working tree", "ratio"]
    assert all(float(v) > 0 for v in rows[0][2:6] + rows[1][2:6])
    assert float(rows[2][-1]) > 0
