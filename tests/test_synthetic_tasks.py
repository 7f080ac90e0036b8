"""Exact-answer snippets (vllm_ddtree.training.synthetic): answers right by construction,
training and evaluation documents disjoint, and the task's metric."""

import ast

import numpy as np
import pytest

from vllm_ddtree.evaluation.metrics import synthetic_results
from vllm_ddtree.training.synthetic import (
    KINDS,
    eval_docs,
    make_doc,
    selection_docs,
    training_texts,
)


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
    assert task_data.synthetic_context_length({}) == 16384 - 96
    assert task_data.synthetic_context_length({"synthetic_context_tokens": "8192"}) == 8192
