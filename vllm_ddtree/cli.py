"""``vllm-ddtree`` command line: ``vllm-ddtree demo [--prompts N] ...``."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-ddtree")
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="complete HumanEval prompts: AR vs DFlash vs DDTree")
    demo.add_argument("--prompts", type=int, default=3)
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--budget", type=int, default=32, help="DDTree nodes per round")
    demo.add_argument("--engine", choices=["reference", "vllm"], default="reference")
    args = parser.parse_args(argv)
    if args.command in (None, "demo"):
        if getattr(args, "engine", "reference") == "vllm":
            from vllm_ddtree.demo.vllm_engine import run_demo_vllm as run_demo
        else:
            from vllm_ddtree.demo.reference_engine import run_demo
        print(run_demo(getattr(args, "prompts", 3), getattr(args, "max_new_tokens", 64),
                       getattr(args, "budget", 32)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
