"""Budget: ``ddtree_budget: "auto"``, the per-round node budget that maximises tokens per
second (cost model measured at start-up, the choice in PyTorch and in Triton)."""
