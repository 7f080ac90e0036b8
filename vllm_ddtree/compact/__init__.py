"""Compact: moving the accepted nodes' KV into consecutive slots (PyTorch reference and
Triton kernel)."""
