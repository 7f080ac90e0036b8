"""``vllm-ddtree`` command line: ``vllm-ddtree demo [--prompts N] ...``.

Arguments are checked by argparse before any model loads: a bad value exits with
status 2 and a message naming the option, the value and the allowed range.
"""

from __future__ import annotations

import argparse

from vllm_ddtree.demo import add_demo_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-ddtree")
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="complete HumanEval prompts: AR vs DFlash vs DDTree")
    add_demo_args(demo)
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
