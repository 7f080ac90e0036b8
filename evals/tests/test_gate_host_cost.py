"""``evals/gate_host_cost.py``: the gate's host time per step, by call (CPU)."""

import gate_host_cost


def test_every_call_of_a_step_is_timed():
    """Each of the gate's three per-step calls ran and was timed after the warm-up."""
    spent = gate_host_cost.host_microseconds(2, steps=40, warmup=40)
    assert set(spent) == set(gate_host_cost.CALLS)
    assert all(us > 0 for us in spent.values()), spent
