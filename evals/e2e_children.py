# SPDX-License-Identifier: Apache-2.0
"""The parent's side of ``evals/bench_e2e.py``'s child processes: start one child per run
and collect its rows (:func:`spawn_child`), or, with ``--lockstep``, start every run's
child (auto's first, alone) and have each cell measured by every run in turn (:func:`run_lockstep`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from e2e_models import Setup
from e2e_runs import (
    STATUS_FAILED,
    STATUS_NOT_RUN,
    RunSpec,
    base_row,
    interleaved,
)

EVALS = Path(__file__).resolve().parent
REPO_ROOT = EVALS.parent
BENCH_SCRIPT = EVALS / "bench_e2e.py"  # the children run ``bench_e2e.py --child SPEC``

# --lockstep: several engines share the GPU, so each gets a fixed KV cache
# (kv_cache_memory_bytes: vLLM skips its memory profiling, which the other engines would
# upset) and a low gpu_memory_utilization (then only read by vLLM's free-memory check at
# start: total x this must be free).
LOCKSTEP_GPU_MEM = 0.05


LOCKSTEP_KV_FACTOR = 3  # vLLM's hybrid KV groups took 2.8x kv_cache_bytes (kimi8, 128k)


def gpu_memory_mib(field: str = "memory.used") -> int | None:
    """nvidia-smi's ``field`` (``memory.used`` / ``memory.total``) in MiB, the largest
    over the visible GPUs; None without nvidia-smi."""
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # other GPUs may run other work
        select = ["-i", visible] if visible else []
        out = subprocess.run(["nvidia-smi", *select, f"--query-gpu={field}",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    values = [int(x) for x in out.stdout.split() if x.strip().isdigit()]
    return max(values) if values else None


def lockstep_fit_problem(num_engines: int, target_weight_bytes: int, kv_bytes: int,
                         gpu_total_bytes: int | None) -> str | None:
    """Why ``num_engines`` ``--lockstep`` engines cannot share the GPU, or None. A lower
    bound: each holds the target's weights and its fixed KV cache (the drafter, CUDA
    graphs, activations and the CUDA context come on top), so a refusal is certain to
    be right and a pass may still run out of memory at the edge. Without a GPU total
    (no nvidia-smi) nothing is refused."""
    need = num_engines * (target_weight_bytes + kv_bytes)
    if gpu_total_bytes is None or need <= gpu_total_bytes:
        return None
    gib = 2**30
    return (f"--lockstep: {num_engines} engines need at least {need / gib:.1f} GiB "
            f"({num_engines} x (target weights {target_weight_bytes / gib:.1f} GiB + KV "
            f"cache {kv_bytes / gib:.1f} GiB), before the drafter, CUDA graphs and "
            f"activations); the GPU has {gpu_total_bytes / gib:.1f} GiB. Pass fewer "
            f"--runs per command (their rows merge into the same JSON) or a smaller "
            f"--lockstep-kv-gib")


def wait_gpu_released(limit_s: float = 90.0, below_mib: int = 2048) -> None:
    """After a child: wait until the GPU's memory is back (a new LLM checks that
    gpu_memory_utilization x total is free at start)."""
    start, last, same = time.time(), None, 0
    while time.time() - start < limit_s:
        used = gpu_memory_mib()
        if used is None or used < below_mib:
            return
        same = same + 1 if used == last else 0
        if same >= 5:
            print(f"GPU memory stays at {used} MiB after the child ended; going on")
            return
        last = used
        time.sleep(2)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child's own process group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def spawn_child(spec: dict, log_path: Path, hard_deadline: float | None, on_rows=None
                ) -> dict:
    """Run one child; return its result JSON ({"meta", "rows"}), whatever it got to.
    ``on_rows(rows)`` is called whenever the child has written more rows."""
    with tempfile.TemporaryDirectory(prefix="bench_e2e_") as tmp:
        spec = dict(spec, out=os.path.join(tmp, "result.json"))
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, str(BENCH_SCRIPT), "--child", spec_path]
        seen = 0
        with open(log_path, "a") as log:
            log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {spec['setup']} "
                      f"{spec['run']}: {shlex.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=str(REPO_ROOT), start_new_session=True)
            killed = False
            try:
                while proc.poll() is None:
                    time.sleep(0.05 if spec.get("fake") else 3.0)
                    seen = _new_rows(spec["out"], seen, on_rows)
                    if hard_deadline and time.time() > hard_deadline:
                        killed = True
                        break
            finally:
                _kill_group(proc)
                proc.wait()
            if killed:
                log.write("\n[bench_e2e] child killed: time limit\n")
        _new_rows(spec["out"], seen, on_rows)
        result = _read_result(spec["out"]) or {"meta": {}, "rows": []}
        result["returncode"] = proc.returncode
        result["killed"] = killed
    if not spec.get("fake"):
        wait_gpu_released()
    return result


def _read_result(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _new_rows(path: str, seen: int, on_rows) -> int:
    result = _read_result(path) if on_rows is not None else None
    rows = (result or {}).get("rows", [])
    if len(rows) > seen:
        on_rows(rows)
        return len(rows)
    return seen


def log_tail(path: Path, lines: int = 400) -> str:
    """The last error-looking line of a log (for rows of a child that died)."""
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    for line in reversed(text):
        if re.search(r"(Error|Exception|Killed|out of memory)", line):
            return line.strip()[:300]
    return ""


def child_spec(setup: Setup, args: argparse.Namespace, run: RunSpec,
               cells: list[tuple[int, int, str]], models, max_model_len: int,
               deadline: float | None, repeat: int = 0, kv_bytes: int | None = None) -> dict:
    """The spec of ``run``'s child (its cells, models and settings; ``kv_bytes``:
    ``--lockstep``'s fixed KV cache, with :data:`LOCKSTEP_GPU_MEM` as
    gpu_memory_utilization, and the child then waits for commands on stdin)."""
    spec = {
        "setup": setup.name, "run": run.name, "cells": [list(c) for c in cells],
        "target": str(models.target), "drafter": str(models.drafter),
        "tokenizer_file": str(models.tokenizer_file) if models.tokenizer_file else None,
        "max_tokens": args.max_tokens, "temperature": args.temperature,
        "eager": args.eager, "gpu_mem": args.gpu_mem, "prime": args.prime,
        "max_model_len": max_model_len, "max_num_seqs": max(c[1] for c in cells),
        "llm_kwargs": args.llm_kwargs, "deadline": deadline, "fake": args.fake,
        "repeat": repeat, "pin_cpus": args.pin_cpus, "engine_process": args.engine_process,
    }
    pool = getattr(args, "pool_spec", None)
    if pool is not None:  # --sweep: the child measures sweep cells (e2e_sweep)
        spec["sweep"] = pool.to_json()
    if kv_bytes:
        spec.update(lockstep=True, kv_cache_memory_bytes=int(kv_bytes),
                    gpu_mem=LOCKSTEP_GPU_MEM,
                    interleave_s=getattr(args, "interleave_s", None))
    return spec


def lockstep_kv_bytes(models, max_model_len: int, batch: int,
                      override_gib: float | None = None) -> int:
    """``kv_cache_memory_bytes`` of every ``--lockstep`` engine: ``override_gib``, else
    ``LOCKSTEP_KV_FACTOR x`` what ``batch`` requests of ``max_model_len`` tokens need
    (``e2e_models.kv_cache_bytes``) + 1 GiB, at least 1 GiB (vLLM refuses to start if
    one max_model_len request does not fit; its hybrid KV-cache groups pad)."""
    if override_gib:
        return int(override_gib * 2**30)
    from e2e_models import kv_cache_bytes, read_config

    kv = kv_cache_bytes(read_config(models.target), read_config(models.drafter),
                        max_model_len, batch)
    return max(2**30, LOCKSTEP_KV_FACTOR * kv["total"] + 2**30)


def lockstep_order(cells: list[tuple[int, int, str]], runs: list[RunSpec],
                   repeats: int) -> list[tuple[tuple[int, int, str], int, RunSpec]]:
    """``(cell, repeat, run)`` in the order ``--lockstep`` measures them: cell after
    cell, each by every run per round, alternate rounds reversed (A B C C B A), so that
    the runs of a cell are measured seconds apart and a drift within a cell falls on
    every run alike; the runs' order rotates by one from cell to cell (B C A, then
    C A B), so that with one round per cell no run always comes first or last."""
    order = []
    for i, cell in enumerate(cells):
        shift = i % len(runs) if runs else 0
        rotated = runs[shift:] + runs[:shift]
        order += [(cell, repeat, run) for repeat, run in interleaved(rotated, repeats)]
    return order


def turn_groups(order: list) -> list[list[tuple[int, tuple]]]:
    """``order`` (:func:`lockstep_order`) numbered and cut into the groups whose runs take
    turns (``--interleave-s``): consecutive entries of one (cell, repeat), no run twice
    in a group (two equal cells in a row, as ``--prompts random random`` makes, are
    two groups)."""
    groups: list[list[tuple[int, tuple]]] = []
    for seq, entry in enumerate(order):
        group = groups[-1] if groups else None
        if (group is None or group[0][1][:2] != entry[:2]
                or any(e[2] == entry[2] for _, e in group)):
            groups.append([])
        groups[-1].append((seq, entry))
    return groups


@dataclass
class LockstepChild:
    """A ``--lockstep`` run's child: its process (stdin a pipe), result file and log;
    ``answered``: rows read from it; ``why`` / ``status``: set once it can answer no more
    (the note and status of its remaining rows)."""

    run: RunSpec
    proc: subprocess.Popen
    out: str
    log: Path
    answered: int = 0
    why: str | None = None
    status: str = STATUS_FAILED
    last_slice: tuple = (None, None)  # --interleave-s: the last (seq, n) acknowledged


def start_lockstep_child(spec: dict, tmp: str, index: int, log_path: Path) -> LockstepChild:
    """Start one ``--lockstep`` child (its own process group, stdin a pipe, its own log beside
    ``log_path``: the children run at once); return it."""
    out = os.path.join(tmp, f"result{index}.json")
    spec = dict(spec, out=out)
    spec_path = os.path.join(tmp, f"spec{index}.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = [sys.executable, str(BENCH_SCRIPT), "--child", spec_path]
    log = log_path.with_suffix(f".lockstep{index}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        f.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {spec['setup']} "
                f"{spec['run']} (lockstep): {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                cwd=str(REPO_ROOT), start_new_session=True, text=True)
    return LockstepChild(RunSpec.parse(spec["run"]), proc, out, log)


def _exit_note(child: LockstepChild) -> str:
    """Why a child that stopped answering did (its exit status and log's last error)."""
    try:
        child.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    return f"child exited {child.proc.returncode}: {log_tail(child.log)}"


def _send(child: LockstepChild, line: str) -> bool:
    """Write one command line to a child's stdin; False if the pipe is gone."""
    try:
        child.proc.stdin.write(line + "\n")
        child.proc.stdin.flush()
        return True
    except (OSError, ValueError):  # BrokenPipeError; closed
        return False


def start_waves(runs: list[RunSpec]) -> list[list[tuple[int, RunSpec]]]:
    """``(index, run)`` in the groups ``--lockstep`` starts together: each
    ``ddtree-auto`` run alone, one after another, then the others. ``auto`` times its
    verify and drafter graphs at start-up (``vllm_ddtree.budget.verify_costs``) and
    budgets every step by them; started beside six other engines capturing their graphs,
    it timed the V2-Lite target's 33-row verify at 7.2 ms against 3.2 ms for 17 rows and
    3.9 ms for 128 (H100), and ran small trees all sweep; two auto variants started
    together timed each other's graphs (1,040 rows: 18.0 and 22.2 ms, drafter at 64
    requests 7.6 and 8.5 ms, where the chain's whole step of 1,024 rows took 14.6). A
    server starts alone on its GPU: so does each auto run here. The other runs measure
    nothing at start-up and start together."""
    indexed = list(enumerate(runs))
    alone = [[(i, r)] for i, r in indexed if r.budget == "auto"]
    rest = [(i, r) for i, r in indexed if r.budget != "auto"]
    return alone + ([rest] if rest else [])


def wait_lockstep_ready(children: list[LockstepChild], limit: float, poll: float,
                        at_deadline: bool) -> None:
    """Wait until every child's result says ``ready``, or it died (``why``: its start
    error or exit), or ``limit`` (the children not ready then are killed: not-run rows
    if ``at_deadline``, the --max-minutes limit, else failed ones)."""
    pending = list(children)
    while pending:
        for child in list(pending):
            meta = (_read_result(child.out) or {}).get("meta") or {}
            if meta.get("ready"):
                pending.remove(child)
            elif child.proc.poll() is not None:
                child.why = meta.get("error") or _exit_note(child)
                # a configuration the front end refused: skipped, not failed
                child.status = meta.get("error_status") or STATUS_FAILED
                pending.remove(child)
        if pending and time.time() > limit:
            for child in pending:
                _kill_group(child.proc)
                child.why, child.status = (
                    ("--max-minutes reached (engine not ready)", STATUS_NOT_RUN) if at_deadline
                    else ("child killed at the time limit (engine not ready)", STATUS_FAILED))
            return
        if pending:
            time.sleep(poll)


def await_lockstep_rows(child: LockstepChild, hard: float, poll: float) -> list[dict] | None:
    """The rows ``child`` wrote past the ones read (polling its result file's stat, so
    that the parent costs the measuring child no CPU), or None when it died or passed
    ``hard`` (then killed); ``child.why`` says which."""
    stamp = None
    while True:
        try:
            st = os.stat(child.out)
            now = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            now = None
        dead = child.proc.poll() is not None
        if now != stamp or dead:  # a dead child: read its last write once more
            stamp = now
            rows = (_read_result(child.out) or {}).get("rows", [])
            if len(rows) > child.answered:
                fresh, child.answered = rows[child.answered:], len(rows)
                return fresh
        if dead:
            child.why = _exit_note(child)
            return None
        if time.time() > hard:
            _kill_group(child.proc)
            child.why = "child killed at the time limit"
            return None
        time.sleep(poll)


def await_lockstep_answer(child: LockstepChild, hard: float, poll: float
                          ) -> tuple[str, list[dict] | None]:
    """``--interleave-s``: a child's next answer, ``("rows", rows)`` (the cell is done),
    ``("slice", None)`` (it acknowledged a slice in its ``.slice`` file and waits for
    ``continue``) or ``("gone", None)`` (dead or past ``hard``; ``child.why`` says
    which). Polls both files' stat, so that the parent costs the stepping child no CPU."""
    from e2e_child import slice_path

    stamps: dict[str, tuple | None] = {}

    def changed(path: str) -> bool:
        try:
            st = os.stat(path)
            now = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            now = None
        moved, stamps[path] = stamps.get(path, "unset") != now, now
        return moved

    while True:
        dead = child.proc.poll() is not None
        if changed(child.out) or dead:
            rows = (_read_result(child.out) or {}).get("rows", [])
            if len(rows) > child.answered:
                fresh, child.answered = rows[child.answered:], len(rows)
                return "rows", fresh
        if changed(slice_path(child.out)):
            ack = _read_result(slice_path(child.out)) or {}
            if (ack.get("seq"), ack.get("n")) != child.last_slice:
                child.last_slice = (ack.get("seq"), ack.get("n"))
                return "slice", None
        if dead:
            child.why = _exit_note(child)
            return "gone", None
        if time.time() > hard:
            _kill_group(child.proc)
            child.why = "child killed at the time limit"
            return "gone", None
        time.sleep(poll)


def stop_lockstep_children(children: list[LockstepChild], log_path: Path, wait_s: float
                           ) -> None:
    """``quit`` to every child, ``wait_s`` for them to leave, then kill their process
    groups; append their logs to ``log_path`` (and remove them)."""
    for child in children:
        _send(child, "quit")
        try:
            child.proc.stdin.close()
        except OSError:
            pass
    end = time.time() + wait_s
    for child in children:
        try:
            child.proc.wait(timeout=max(0.1, end - time.time()))
        except subprocess.TimeoutExpired:
            pass
        _kill_group(child.proc)
        child.proc.wait()
    with open(log_path, "a") as log:
        for child in children:
            try:
                log.write(child.log.read_text(errors="replace"))
                child.log.unlink()
            except OSError:
                pass


def run_lockstep(setup: Setup, args: argparse.Namespace, runs: list[RunSpec],
                 cells: list[tuple[int, int, str]], models, max_model_len: int,
                 log_path: Path, add_rows, progress, deadline: float | None,
                 invocation: dict) -> None:
    """``--lockstep``: start every run's child (each auto run first, alone: :func:`start_waves`),
    wait for their engines, then send
    each cell to every run in turn (:func:`lockstep_order`), waiting for one child's row
    before the next command, so that one engine works at a time. ``--interleave-s S``
    (sweeps): a cell's runs start one after another, each handing over after S s of
    steps, and go round until each has spent its pool, so that the host's speed, which
    toggles within seconds, falls on every run alike. ``add_rows(rows)`` gets every row
    (measured, failed, not run) as it comes."""
    kv = lockstep_kv_bytes(models, max_model_len, max(c[1] for c in cells),
                           args.lockstep_kv_gib)
    if not args.fake:
        from e2e_models import weight_bytes

        total_mib = gpu_memory_mib("memory.total")
        problem = lockstep_fit_problem(len(runs), weight_bytes(models.target), kv,
                                       total_mib * 2**20 if total_mib else None)
        if problem:
            raise SystemExit(f"{setup.name}: {problem}")
    invocation["lockstep_kv_cache_gib"] = round(kv / 2**30, 2)
    invocation["lockstep_gpu_mem"] = LOCKSTEP_GPU_MEM
    print(f"{setup.name}: lockstep, {len(runs)} engines at once, kv_cache_memory_bytes "
          f"{kv / 2**30:.2f} GiB each")
    order = lockstep_order(cells, runs, args.repeats)

    def row(cell, repeat, run, status, note):
        return dict(base_row(setup.name, run, cell, args.max_tokens, repeat,
                             args.engine_process, args.temperature), status=status, note=note)

    if deadline and time.time() > deadline - 60 * args.min_child_minutes:
        add_rows([row(c, r, run, STATUS_NOT_RUN, "--max-minutes reached") for c, r, run in order])
        if progress is not None:
            progress.update(len(order))
        return
    poll = 0.002 if getattr(args, "interleave_s", 0) else 0.05  # slices: a prompt hand-over
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_e2e_lockstep_") as tmp:
        children: list[LockstepChild] = []
        try:
            limit = start + 60 * args.child_timeout_min
            for wave in start_waves(runs):
                started = []
                for i, run in wave:
                    spec = child_spec(setup, args, run, cells, models, max_model_len,
                                      deadline, kv_bytes=kv)
                    started.append(start_lockstep_child(spec, tmp, i, log_path))
                children += started
                wait_lockstep_ready(started, min(limit, deadline) if deadline else limit,
                                    poll if args.fake else 1.0,
                                    bool(deadline) and deadline < limit)
            children.sort(key=lambda child: runs.index(child.run))
            for child in children:
                meta = (_read_result(child.out) or {}).get("meta") or {}
                if meta.get("gpu"):
                    invocation["gpu"] = meta["gpu"]
                if meta.get("versions"):
                    invocation["versions"] = meta["versions"]
                invocation.setdefault("startup_s", {})[child.run.name] = meta.get("startup_s")
            by_run = {child.run: child for child in children}
            interleave = bool(getattr(args, "interleave_s", 0))

            def cell_limit() -> float:  # a cell's hard limit, from its first command
                hard = time.time() + 60 * args.child_timeout_min
                return min(hard, deadline + 60 * args.grace_minutes) if deadline else hard

            def answer(child: LockstepChild, line: str, hard: float
                       ) -> tuple[str, list[dict] | None]:
                if child.why is not None:
                    return "gone", None
                if not _send(child, line):
                    child.why = _exit_note(child)
                    return "gone", None
                if interleave:
                    return await_lockstep_answer(child, hard, poll)
                rows = await_lockstep_rows(child, hard, poll)
                return ("rows", rows) if rows is not None else ("gone", None)

            def done(child, cell, repeat, run, rows) -> None:
                add_rows(rows or [row(cell, repeat, run, child.status, child.why)])
                if progress is not None:
                    progress.update(1)

            # A cell's runs one after another; with --interleave-s each hands over after
            # a turn of steps and they go round until each has spent its pool.
            for group in turn_groups(order):
                # A cell starts for all its runs or for none: one started alone before
                # --max-minutes and finished in its grace is a row nothing compares with.
                late = bool(deadline) and time.time() > deadline
                waiting = []
                for seq, (cell, repeat, run) in group:
                    child = by_run[run]
                    if progress is not None:
                        progress.set_postfix_str(f"{setup.name} {run.name}")
                    if child.why is None and late:
                        done(child, cell, repeat, run,
                             [row(cell, repeat, run, STATUS_NOT_RUN, "--max-minutes reached")])
                        continue
                    hard = cell_limit()
                    kind, rows = answer(child, json.dumps(
                        {"cell": list(cell), "repeat": repeat, "seq": seq}), hard)
                    if kind == "slice":
                        waiting.append((child, cell, repeat, run, hard))
                    else:
                        done(child, cell, repeat, run, rows)
                while waiting:
                    for item in list(waiting):
                        child, cell, repeat, run, hard = item
                        # past --max-minutes and its grace the child stops the cell
                        # itself (a not-run row), not killed at its hard limit
                        late = deadline and time.time() > deadline + 60 * args.grace_minutes
                        kind, rows = answer(child, "abort" if late else "continue",
                                            hard + 60 if late else hard)
                        if kind != "slice":
                            waiting.remove(item)
                            done(child, cell, repeat, run, rows)
        finally:
            stop_lockstep_children(children, log_path, 2.0 if args.fake else 30.0)
    if not args.fake:
        wait_gpu_released()
