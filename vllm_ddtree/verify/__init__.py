"""Verify: the target's one-forward tree verification in vLLM (the verifier that replaces
the chain rejection sampler, the verify batch's positions and mask bits, the verify shapes)."""
