"""Walk: the acceptance walk down a verified tree (PyTorch reference and Triton kernel)."""
