"""Packaging: the top-level source folders ``attention_backends/`` and ``patches/`` install
as ``vllm_ddtree.attention_backends`` and ``vllm_ddtree.patches``, so the wheel puts one
import package, ``vllm_ddtree``, into site-packages. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

MAPPED_FOLDERS = ("attention_backends", "patches")

packages = find_packages(include=["vllm_ddtree", "vllm_ddtree.*"])
package_dir = {"vllm_ddtree": "vllm_ddtree"}
for folder in MAPPED_FOLDERS:
    package_dir[f"vllm_ddtree.{folder}"] = folder
    packages += [f"vllm_ddtree.{p}" for p in find_packages(include=[folder, f"{folder}.*"])]

setup(packages=packages, package_dir=package_dir)
