"""Tree: best-first draft trees from the drafter's per-depth distributions, their
ancestor-mask bits, and the Triton kernels that build and store them."""
