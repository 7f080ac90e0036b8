"""Exact-answer snippets (vllm_ddtree.training.synthetic): answers right by construction,
training and evaluation documents disjoint, long copies, and the tasks' metric."""

import ast
import importlib.util
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from vllm_ddtree.evaluation.metrics import synthetic_results
from vllm_ddtree.training.synthetic import (
    KINDS,
    eval_docs,
    make_doc,
    selection_docs,
    training_kind,
    training_texts,
)

TASKS = Path(__file__).resolve().parents[1] / "evals" / "tasks"


def _copies(n: int = 100) -> list[dict]:
    return eval_docs(n, kinds=("copy",))


def _max_gen_toks(task: str) -> int:
    text = (TASKS / f"{task}.yaml").read_text().replace("!function", "")
    return yaml.safe_load(text)["generation_kwargs"]["max_gen_toks"]


def _task_utils():
    spec = importlib.util.spec_from_file_location("ddtree_task_utils", TASKS / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_answer_is_right():
    for doc in eval_docs(25):
        code = doc["context"] + doc["target"]
        tree = ast.parse(code)  # brackets closed, copies indented: valid Python
        if doc["kind"] in ("lookup", "sort"):
            exec(compile(tree, "<doc>", "exec"), {})  # the assert holds
        if doc["kind"] == "copy":
            first, second = (n for n in tree.body if isinstance(n, ast.FunctionDef))
            assert ast.dump(first.args) == ast.dump(second.args)
            assert [ast.dump(s) for s in first.body] == [ast.dump(s) for s in second.body]
            # the answer is the first body's text, line for line
            assert doc["target"] == "\n" + doc["context"].split("\n\n\n")[0].split(":\n", 1)[1]
            namespace = {}
            exec(compile(ast.Module([first], []), "<doc>", "exec"), namespace)
            args = range(len(first.args.args))  # any ints, 0 too: no division by an argument
            assert isinstance(namespace[first.name](*args), int)
        assert "\n\n" not in doc["target"]  # the tasks stop at a blank line
        if doc["kind"] == "brackets":
            with pytest.raises(SyntaxError):
                ast.parse(doc["context"] + doc["target"][:-1])


def test_documents_are_deterministic_and_disjoint_from_training():
    assert eval_docs(3) == eval_docs(3) and make_doc("sort", 5) == make_doc("sort", 5)
    train = set(training_texts(400).values())
    assert not train & {d["context"] + d["target"] + "\n" for d in eval_docs(25)}
    assert {k.split("/")[1].split("_")[0] for k in training_texts(8)} == set(KINDS)
    selection = {prompt + answer + "\n" for _, prompt, answer in selection_docs(25)}
    assert len(selection) == 100 and not selection & train
    assert not selection & {d["context"] + d["target"] + "\n" for d in eval_docs(25)}
    with pytest.raises(ValueError, match="kind='nope' is not allowed"):
        make_doc("nope", 0)


def test_copy_answers_are_long_and_fit_the_tasks_generation():
    from vllm_ddtree.evaluation import task_data

    tokenizer = task_data.tokenizer_for({})  # the shipped target's
    docs = _copies()
    lengths = [len(tokenizer.encode(d["target"], add_special_tokens=False)) for d in docs]
    assert sum(lengths) / len(lengths) >= 40 and min(lengths) >= 20, lengths
    assert all(d["target"].startswith("\n") and "\n\n" not in d["target"] for d in docs)
    for task in ("ddtree_synthetic", "ddtree_synthetic_16k", "ddtree_copy", "ddtree_copy_16k"):
        assert _max_gen_toks(task) >= max(lengths) + 16, task
        assert _max_gen_toks(task) == task_data.SYNTHETIC_MAX_GEN_TOKENS
    assert task_data.DEFAULT_SYNTHETIC_CONTEXT_TOKENS + task_data.SYNTHETIC_MAX_GEN_TOKENS \
        == 16384
    # a whole document (prompt + answer) stays inside a 512-token training window
    train = list(training_texts(400).values())
    assert max(len(tokenizer.encode(t, add_special_tokens=False)) for t in train) < 480


def test_copy_bodies_must_be_read_not_rebuilt_from_the_header():
    reused = reordered = 0
    for doc in _copies():
        header = doc["context"].rsplit("(", 1)[1].split(")")[0].split(", ")
        used = [w for w in re.findall(r"[a-z_]+", doc["target"]) if w in header]
        reused += len(used) > len(set(used))
        first_uses = list(dict.fromkeys(used))
        reordered += first_uses != [a for a in header if a in first_uses]
        assert 2 <= len(header) <= 6
        assert not re.search(r"\b(" + "|".join(header) + r") = ", doc["target"])  # acc apart
    assert reused >= 60 and reordered >= 40, (reused, reordered)


def test_training_mix_is_half_copies():
    kinds = Counter(k.split("/")[1].rsplit("_", 1)[0] for k in training_texts(600))
    assert kinds == {"copy": 300, "lookup": 100, "brackets": 100, "sort": 100}
    assert [training_kind(i) for i in range(6)] == ["copy", "lookup", "copy", "brackets",
                                                    "copy", "sort"]


def test_copy_tasks_documents():
    utils = _task_utils()
    copies = utils.copy_dataset()["test"].to_list()
    assert len(copies) == 100 and {d["kind"] for d in copies} == {"copy"}
    assert len({d["context"] for d in copies}) == 100
    # the first 25 are ddtree_synthetic's copies: the same evaluation seeds
    assert copies[:25] == [d for d in eval_docs(25) if d["kind"] == "copy"]
    long = utils.copy_16k_dataset(synthetic_context_tokens=1500)["test"].to_list()
    assert [d["target"] for d in long] == [d["target"] for d in copies]
    for doc, short in zip(long, copies, strict=True):
        assert doc["context"].endswith(short["context"]) and doc["kind"] == "copy"
        assert 1400 <= doc["prompt_tokens"] <= 1500
    for name in ("ddtree_copy", "ddtree_copy_16k"):
        text = (TASKS / f"{name}.yaml").read_text().replace("!function", "")
        synthetic = name.replace("copy", "synthetic")
        twin = (TASKS / f"{synthetic}.yaml").read_text().replace("!function", "")
        assert yaml.safe_load(text).get("tag") == yaml.safe_load(twin).get("tag")


def test_exact_match_needs_the_whole_answer_and_nothing_glued_to_it():
    doc = {"target": " 302"}
    assert synthetic_results(doc, [" 302"])["exact_match"] == 1.0
    assert synthetic_results(doc, [" 302\nassert x"])["exact_match"] == 1.0
    assert synthetic_results(doc, [" 3021"])["exact_match"] == 0.0
    assert synthetic_results(doc, [" 30"])["exact_match"] == 0.0
    closing = {"target": ")}]"}
    assert synthetic_results(closing, [")}]]"])["exact_match"] == 0.0
    assert synthetic_results(closing, [")}]"])["edit_similarity"] == 1.0


def test_corpus_puts_synthetic_documents_in_train_only(tmp_path):
    from vllm_ddtree.training import corpus

    kwargs = dict(vocab_size=300, max_files=3)
    plain = corpus.build_corpus(tmp_path / "plain", **kwargs)
    mixed = corpus.build_corpus(tmp_path / "mixed", synthetic_docs=8, **kwargs)
    assert mixed["synthetic_docs"] == 8
    assert mixed["splits"]["train"]["files"] == plain["splits"]["train"]["files"] + 8
    assert mixed["splits"]["train"]["tokens"] > plain["splits"]["train"]["tokens"]
    for split in ("valid", "heldout"):
        assert mixed["splits"][split] == plain["splits"][split]
    assert sum(p["path"].startswith("synthetic/") for p in mixed["train_files"]) == 8
    # a fine-tune's anchor text: the same code files as the plain corpus's train split
    # (in the mixed corpus's shuffled order), no snippet
    code = corpus.load_code_train(tmp_path / "mixed")
    plain_train = corpus.load_split(tmp_path / "plain", "train")
    assert mixed["code_train_npy"] == "train_code.npy" and plain["code_train_npy"] is None
    assert np.array_equal(np.sort(code), np.sort(plain_train))
    assert np.array_equal(corpus.load_code_train(tmp_path / "plain"), plain_train)


def test_long_documents_fill_the_budget_and_end_with_the_snippet():
    from vllm_ddtree.evaluation import task_data

    tokenizer = task_data.tokenizer_for({})
    snippets = eval_docs(2)
    docs = task_data.synthetic_long_docs(tokenizer, 2000, snippets)
    for doc, snippet in zip(docs, snippets, strict=True):
        counted = len(tokenizer.encode(doc["context"], add_special_tokens=False))
        assert doc["prompt_tokens"] == counted and 1900 <= counted <= 2000, counted
        assert doc["context"].endswith(task_data.SNIPPET_SEPARATOR + snippet["context"])
        assert doc["target"] == snippet["target"] and doc["kind"] == snippet["kind"]
        assert doc["context"].startswith("# ===== ")
    assert len({d["context"][:200] for d in docs}) == len(docs)  # fillers rotate
    with pytest.raises(ValueError, match="synthetic_context_tokens 500000 needs more text"):
        task_data.synthetic_long_docs(tokenizer, 500_000, snippets)
    assert task_data.synthetic_context_length({}) == 16384 - 136
    assert task_data.synthetic_context_length({"synthetic_context_tokens": "8192"}) == 8192
