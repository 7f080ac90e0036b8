"""``evals/validate.py``'s per-kind table: a task whose documents have kinds
(``ddtree_synthetic``: copy, lookup, brackets, sort) reports each kind's mean beside
the task's, since one kind can score well where the task's mean does not."""

import pytest
from evals_scripts import load_evals_script


def test_by_kind_table_gives_each_kinds_mean_for_both_runs():
    validate = load_evals_script("validate")
    items = {0: 1.0, 1: 1.0, 2: 0.0, 3: 1.0, 4: 0.0}
    kinds = {0: "copy", 1: "copy", 2: "sort", 3: "lookup", 4: "sort"}

    def run(label, flip=None):
        scores = {d: {"exact_match": (1.0 - v if d == flip else v)} for d, v in items.items()}
        return validate.TaskRun(label, {"exact_match": 0.6}, {d: "" for d in items}, 1.0,
                                items=scores, kinds=kinds)

    lines = validate.by_kind_markdown(run("ar"), run("ddtree", flip=1))
    assert lines[3] == "| kind | docs | exact_match (ar) | exact_match (ddtree) |"
    assert lines[5:] == ["| copy | 2 | 1.0000 | 0.5000 |", "| sort | 2 | 0.0000 | 0.0000 |",
                         "| lookup | 1 | 1.0000 | 1.0000 |"]
    no_kinds = validate.TaskRun("ar", {"exact_match": 0.6}, {}, 1.0)
    assert validate.by_kind_markdown(no_kinds, no_kinds) == []


def test_run_task_keeps_the_synthetic_documents_kinds():
    pytest.importorskip("lm_eval")
    validate = load_evals_script("validate")
    from vllm_ddtree.evaluation.ref_lm import DDTreeRefLM, load_pair

    lm = DDTreeRefLM(method="ar", pair=load_pair(None, None, need_drafter=False), threads=1)
    run = validate.run_task(lm, "ddtree_synthetic", 2, {}, {"max_gen_toks": 4}, "ar")
    assert run.kinds == {0: "copy", 1: "copy"}
    assert set(run.items) == {0, 1} and "exact_match" in run.items[0]
