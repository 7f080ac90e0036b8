"""Draft: the DFlash drafter's round inside vLLM (``DDTreeSpeculator``), its context rows
and context K/V graphs, and the Triton kernels that prepare its inputs."""
