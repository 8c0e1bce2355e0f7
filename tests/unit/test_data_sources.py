"""Sources, tokenizers and the token cache: real files in tmp_path, bad data under both policies."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_hotspa.data import (
    ByteTokenizer,
    DataError,
    HFDiskSource,
    HFTokenizer,
    JsonlSource,
    LengthGenerator,
    MissingDependencyError,
    ParquetSource,
    StdlibCorpusSource,
    SyntheticSource,
    TextFolderSource,
    TokenizedCorpus,
    build_source,
    build_tokenizer,
    cache_key,
    fit_lognormal,
)
from lightning_hotspa.data.sources import TEST_DIR_NAMES, stdlib_root


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


# -- TextFolderSource ------------------------------------------------------------------------


def test_text_folder_recursive_sorted_bytes_and_empty_counted(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_bytes(b"zz")
    (tmp_path / "a.md").write_bytes(b"# title")
    (tmp_path / "b" / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    (tmp_path / "empty.py").write_bytes(b"")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    (tmp_path / ".hidden.txt").write_bytes(b"hidden")
    src = TextFolderSource(tmp_path)
    docs = list(src)
    assert [d for d, _ in docs] == ["a.md", "b/latin1.txt", "b/z.txt"]
    assert docs[1][1] == b"caf\xe9"
    assert src.stats.documents == 3 and src.stats.empty_skipped == 1
    assert list(src) == docs  # a second pass is identical and stats are per pass
    assert src.stats.documents == 3


def test_text_folder_missing_and_empty_paths(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match="does not exist.*nope"):
        TextFolderSource(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no files ending in.*empty"):
        TextFolderSource(tmp_path / "empty")


# -- JsonlSource -----------------------------------------------------------------------------


def test_jsonl_reads_records_in_file_order(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "b.jsonl", ['{"text": "second file"}'])
    write_jsonl(
        tmp_path / "a.jsonl", ['{"text": "one", "id": 7}', "", '{"text": ""}', '{"text": "two"}']
    )
    src = JsonlSource(tmp_path)
    assert list(src) == [("a.jsonl:1", "one"), ("a.jsonl:4", "two"), ("b.jsonl:1", "second file")]
    assert src.stats.empty_skipped == 1 and src.stats.bad_records_skipped == 0
    by_id = JsonlSource(tmp_path / "a.jsonl", id_field="id")
    assert [d for d, _ in by_id][0] == "7"


BAD_LINES = {
    "not json": ("{not json", "not valid JSON"),
    "missing field": ('{"body": "x"}', "missing text field 'text'"),
    "text not a string": ('{"text": 42}', "is int, not a string"),
    "not an object": ("[1, 2]", "expected a JSON object"),
    "invalid utf-8": (b'{"text": "\xff"}', "not valid JSON"),
}


def _jsonl_around(tmp_path: Path, case: str, blank: bool) -> Path:
    """A JSONL file: a good record, (a blank line,) the bad record of ``case``, a good record."""
    bad = BAD_LINES[case][0]
    path = tmp_path / "data.jsonl"
    bad_bytes = bad if isinstance(bad, bytes) else bad.encode()
    path.write_bytes(b'{"text": "ok"}\n' + (b"\n" if blank else b"") + bad_bytes + b'\n{"text": "after"}\n')
    return path


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_jsonl_bad_record_raise_names_file_and_line(tmp_path: Path, case: str) -> None:
    reason = BAD_LINES[case][1]
    path = _jsonl_around(tmp_path, case, blank=True)
    with pytest.raises(DataError) as err:
        list(JsonlSource(path))
    assert str(path) in str(err.value) and "line 3" in str(err.value) and reason in str(err.value)


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_jsonl_bad_record_skip_counts(tmp_path: Path, case: str) -> None:
    path = _jsonl_around(tmp_path, case, blank=False)
    src = JsonlSource(path, on_bad_record="skip")
    assert [t for _, t in src] == ["ok", "after"]
    assert src.stats.bad_records_skipped == 1 and "line 2" in src.stats.notes[0]


def test_bad_policy_value_is_rejected(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", ['{"text": "x"}'])
    with pytest.raises(DataError, match="on_bad_record.*'ignore'"):
        JsonlSource(tmp_path, on_bad_record="ignore")  # type: ignore[arg-type]


# -- ParquetSource ---------------------------------------------------------------------------


def write_parquet(path: Path, column: list, name: str = "text", binary: bool = False) -> Path:
    # pyarrow is in the test extra: imported here, so a missing one fails the parquet tests by name
    # instead of skipping this whole module
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({name: pa.array(column, type=pa.binary() if binary else None)}), path)
    return path


def test_parquet_reads_rows_across_files_and_batches(tmp_path: Path) -> None:
    write_parquet(tmp_path / "b.parquet", ["b0"])
    write_parquet(tmp_path / "a.parquet", [f"a{i}" for i in range(5)] + [""])
    write_parquet(tmp_path / "c.parquet", ["café raw".encode()], binary=True)  # binary: UTF-8 like any text
    src = ParquetSource(tmp_path, batch_size=2)
    docs = list(src)
    assert [d for d, _ in docs] == [f"a.parquet:{i}" for i in range(5)] + [
        "b.parquet:0",
        "c.parquet:0",
    ]
    assert docs[-1][1] == "café raw".encode()
    assert src.stats.empty_skipped == 1


def test_parquet_null_row_raise_names_file_and_row_then_skip(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "a.parquet", ["x", None, "y"])
    with pytest.raises(DataError, match=r"a\.parquet row 1: null 'text'"):
        list(ParquetSource(path))
    src = ParquetSource(path, on_bad_record="skip")
    assert [t for _, t in src] == ["x", "y"] and src.stats.bad_records_skipped == 1


@pytest.mark.parametrize(
    ("maker", "reason"),
    [
        (lambda p: p.write_bytes(b"this is not parquet"), "unreadable parquet file"),
        (lambda p: write_parquet(p, ["x"], name="content"), "no column 'text'"),
        (lambda p: write_parquet(p, [1, 2]), "not string/binary"),
    ],
)
def test_parquet_bad_file_under_both_policies(tmp_path: Path, maker, reason: str) -> None:
    write_parquet(tmp_path / "a_good.parquet", ["good"])
    bad = tmp_path / "b_bad.parquet"
    maker(bad)
    with pytest.raises(DataError) as err:
        list(ParquetSource(tmp_path))
    assert str(bad) in str(err.value) and reason in str(err.value)
    src = ParquetSource(tmp_path, on_bad_record="skip")
    assert [t for _, t in src] == ["good"] and src.stats.bad_files_skipped == 1


def test_parquet_without_pyarrow_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_parquet(tmp_path / "a.parquet", ["x"])
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(MissingDependencyError, match="ParquetSource.*pip install pyarrow"):
        ParquetSource(tmp_path)


# -- HFDiskSource ----------------------------------------------------------------------------


def fake_datasets(monkeypatch: pytest.MonkeyPatch, saved: object) -> None:
    module = types.ModuleType("datasets")
    module.load_from_disk = lambda path: saved  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", module)


def test_hf_disk_missing_package_and_missing_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(DataError, match="does not exist.*nowhere"):
        HFDiskSource(tmp_path / "nowhere")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(MissingDependencyError, match="pip install datasets"):
        HFDiskSource(tmp_path)


def test_hf_disk_rows_bad_records_and_splits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = [{"text": "a"}, {"text": None}, {"text": 3}, {"other": "x"}, {"text": "b"}]
    fake_datasets(monkeypatch, rows)
    with pytest.raises(DataError, match="row 1: missing or null text field"):
        list(HFDiskSource(tmp_path))
    src = HFDiskSource(tmp_path, on_bad_record="skip")
    assert list(src) == [("data:0", "a"), ("data:4", "b")]
    assert src.stats.bad_records_skipped == 3
    fake_datasets(monkeypatch, {"train": rows[:1], "test": rows[4:]})
    with pytest.raises(DataError, match=r"splits \['test', 'train'\]"):
        list(HFDiskSource(tmp_path))
    assert list(HFDiskSource(tmp_path, split="test")) == [("test:0", "b")]


# -- StdlibCorpusSource ----------------------------------------------------------------------


def stdlib_files(include_tests: bool) -> list[Path]:
    root = stdlib_root()
    skip = {"site-packages", "dist-packages", "__pycache__"} | (
        set() if include_tests else TEST_DIR_NAMES
    )
    out = []
    for f in root.rglob("*.py"):
        parts = f.relative_to(root).parts
        if not any(p in skip or p.startswith(".") for p in parts[:-1]) and not parts[-1].startswith(
            "."
        ):
            out.append(f)
    return out


def test_stdlib_corpus_counts_empty_and_keeps_non_utf8() -> None:
    files = stdlib_files(include_tests=True)
    expected_empty = sum(f.stat().st_size == 0 for f in files)
    non_utf8 = set()
    for f in files:
        try:
            f.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            non_utf8.add(f.relative_to(stdlib_root()).as_posix())
    src = StdlibCorpusSource()
    docs = dict(src)
    assert expected_empty > 0 and non_utf8, "this interpreter's stdlib should be messy"
    assert src.stats.empty_skipped == expected_empty
    assert src.stats.documents == len(files) - expected_empty == len(docs)
    assert non_utf8 <= set(docs) and all(isinstance(docs[d], bytes) for d in non_utf8)
    assert not any("site-packages" in d for d in docs)
    ids = list(docs)
    assert ids == sorted(ids)
    if sys.version_info[:2] == (3, 11):  # docs/DESIGN.md §7, trap "The bundled corpus is not clean"
        assert (expected_empty, len(non_utf8)) == (28, 4)


def test_stdlib_corpus_can_leave_out_tests() -> None:
    src = StdlibCorpusSource(include_tests=False)
    assert (
        len(src.files) == len(stdlib_files(include_tests=False)) < len(StdlibCorpusSource().files)
    )
    assert not any(set(f.relative_to(src.root).parts) & TEST_DIR_NAMES for f in src.files)


# -- Length generators and the factory -------------------------------------------------------


def token_share_above(lengths: np.ndarray, cut: int) -> float:
    return float(lengths[lengths > cut].sum() / lengths.sum())


def test_length_generators_shapes_and_determinism() -> None:
    cc = LengthGenerator(kind="commoncrawl", seed=1).lengths(20000)
    gh = LengthGenerator(kind="github", seed=1).lengths(20000)
    assert token_share_above(cc, 4096) < 0.15 < 0.85 < token_share_above(gh, 4096)
    assert 550 < cc.mean() < 700  # the RefinedWeb-card mean the profile is built on
    assert np.array_equal(cc, LengthGenerator(kind="commoncrawl", seed=1).lengths(20000))
    assert not np.array_equal(cc, LengthGenerator(kind="commoncrawl", seed=2).lengths(20000))
    uni = LengthGenerator(kind="uniform", params={"low": 5, "high": 9}).lengths(1000)
    assert uni.min() == 5 and uni.max() == 9
    bi = LengthGenerator(kind="bimodal", params={"long_fraction": 0.25}).lengths(20000)
    assert 0.22 < (bi > 4096).mean() < 0.28
    capped = LengthGenerator(kind="github", max_length=1000, scale=0.5).lengths(500)
    assert capped.max() == 1000 and capped.min() >= 1
    docs = LengthGenerator(kind="uniform").token_documents(4, vocab_size=7)
    assert [d.size for d in docs] == LengthGenerator(kind="uniform").lengths(4).tolist()
    assert all(d.dtype == np.int32 and d.max() < 7 for d in docs)


def test_fit_lognormal_recovers_parameters() -> None:
    sample = np.random.default_rng(0).lognormal(8.5, 1.9, size=50000)
    mu, sigma = fit_lognormal(sample)
    assert abs(mu - 8.5) < 0.05 and abs(sigma - 1.9) < 0.05


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "wikipedia"}, "kind must be one of"),
        ({"kind": "github", "params": {"mean": 3}}, "unknown params"),
        ({"min_length": 0}, "min_length"),
        ({"min_length": 10, "max_length": 5}, "max_length=5"),
        ({"kind": "uniform", "params": {"low": 9, "high": 5}}, "low <= high"),
    ],
)
def test_length_generator_rejects_bad_config(kwargs: dict, match: str) -> None:
    with pytest.raises(DataError, match=match):
        LengthGenerator(**kwargs)


def test_build_source_factory(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", ['{"body": "x"}'])
    src = build_source("jsonl", path=tmp_path, text_field="body")
    assert isinstance(src, JsonlSource) and list(src) == [("a.jsonl:1", "x")]
    with pytest.raises(DataError, match="unknown data source kind 'csv'.*jsonl"):
        build_source("csv", path=tmp_path)
    with pytest.raises(DataError, match="bad arguments"):
        build_source("jsonl", folder=tmp_path)
    syn = build_source("synthetic", num_documents=5, kind="uniform", seed=3)
    assert [len(d) for _, d in syn] == LengthGenerator(kind="uniform", seed=3).lengths(5).tolist()


# -- Tokenizers ------------------------------------------------------------------------------


@given(st.binary(max_size=200))
@settings(max_examples=50, deadline=None)
def test_byte_tokenizer_takes_any_bytes(raw: bytes) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(raw)
    assert ids.dtype == np.int32 and ids.size == len(raw) and tok.decode(ids) == raw


def test_byte_tokenizer_specials_and_str() -> None:
    tok = ByteTokenizer(("<pad>", "<eos>"), append_eos=True)
    assert tok.vocab_size == 258 and tok.eos_id == 257
    assert tok.encode("é\ud800").tolist()[-1] == 257  # a lone surrogate still encodes
    assert tok.encode("é").tolist() == [0xC3, 0xA9, 257]
    with pytest.raises(DataError, match="append_eos"):
        ByteTokenizer((), append_eos=True)
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(DataError, match="unknown tokenizer kind 'bpe'"):
        build_tokenizer("bpe")


def make_hf_tokenizer_file(path: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3, "café": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_hf_tokenizer_from_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = HFTokenizer(make_hf_tokenizer_file(tmp_path / "tokenizer.json"))
    assert tok.encode("hello world nope").tolist() == [2, 3, 0]
    assert tok.encode("café".encode()).tolist() == [4]
    assert [a.tolist() for a in tok.encode_batch(["world", b"hello"])] == [[3], [2]]
    assert tok.vocab_size == 5 and tok.eos_id == 1 and tok.storage_dtype == np.uint16
    with pytest.raises(DataError, match="does not exist.*missing.json"):
        HFTokenizer(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(DataError, match="cannot load.*broken.json"):
        HFTokenizer(tmp_path / "broken.json")
    with pytest.raises(DataError, match="no token '<eos>'"):
        HFTokenizer(tmp_path / "tokenizer.json", eos_token="<eos>")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(MissingDependencyError, match="pip install tokenizers"):
        HFTokenizer(tmp_path / "tokenizer.json")


# -- Token cache -----------------------------------------------------------------------------


def folder(tmp_path: Path, files: dict[str, bytes]) -> Path:
    root = tmp_path / "corpus"
    root.mkdir(exist_ok=True)
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


def test_cache_miss_then_hit_with_same_content(tmp_path: Path) -> None:
    root = folder(tmp_path, {"a.txt": b"hello", "b.txt": b"", "c.txt": b"\xff\x00xyz"})
    cache = tmp_path / "cache"
    first = TokenizedCorpus.build(TextFolderSource(root), ByteTokenizer(), cache)
    second = TokenizedCorpus.build(TextFolderSource(root), ByteTokenizer(), cache)
    assert (first.cache_hit, second.cache_hit) == (False, True)
    assert isinstance(second.tokens, np.memmap) and second.tokens.dtype == np.uint16
    for c in (first, second):
        assert len(c) == 2 and c.lengths.tolist() == [5, 5] and c.num_tokens == 10
        assert c.doc(1).tolist() == [255, 0, 120, 121, 122] and c.doc(1).dtype == np.int32
        assert c.doc(1, 1, 3).tolist() == [0, 120] and c.doc_id(0) == "a.txt"
        assert c.stats.empty_skipped == 1 and c.stats.documents == 2
    with pytest.raises(IndexError, match="document index 2"):
        first.doc(2)
    shipped = pickle.dumps(second)  # what a spawned loader worker receives: the path, not tokens
    assert len(shipped) < 1000 and pickle.loads(shipped).doc(1).tolist() == c.doc(1).tolist()
    memory = TokenizedCorpus.build(TextFolderSource(root), ByteTokenizer(), use_cache=False)
    assert np.array_equal(memory.tokens, first.tokens) and memory.stats == first.stats
    assert pickle.loads(pickle.dumps(memory)).doc(0).tolist() == list(b"hello")
    memory.doc(0)[:] = 0  # doc() hands out a copy, never a view into the corpus
    assert memory.doc(0).tolist() == list(b"hello")


def test_cache_invalidated_by_source_or_tokenizer_change(tmp_path: Path) -> None:
    root = folder(tmp_path, {"a.txt": b"hello"})
    cache = tmp_path / "cache"
    base = TokenizedCorpus.build(TextFolderSource(root), ByteTokenizer(), cache)
    (root / "a.txt").write_bytes(b"hello, world")
    edited = TokenizedCorpus.build(TextFolderSource(root), ByteTokenizer(), cache)
    assert not edited.cache_hit and edited.key != base.key and edited.num_tokens == 12
    eos = TokenizedCorpus.build(TextFolderSource(root), ByteTokenizer(append_eos=True), cache)
    assert not eos.cache_hit and eos.num_tokens == 13
    assert TokenizedCorpus.build(
        TextFolderSource(root), ByteTokenizer(append_eos=True), cache
    ).cache_hit
    os.utime(root / "a.txt", ns=(1, 1))  # same size, other mtime: still a different source
    assert not TokenizedCorpus.build(TextFolderSource(root), ByteTokenizer(), cache).cache_hit


def test_crash_before_publish_leaves_no_trusted_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = folder(tmp_path, {"a.txt": b"hello"})
    cache = tmp_path / "cache"
    src, tok = TextFolderSource(root), ByteTokenizer()

    def crash(*args: object) -> None:
        raise KeyboardInterrupt("killed before os.replace")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        TokenizedCorpus.build(src, tok, cache)
    monkeypatch.undo()
    assert list(cache.iterdir()) == []  # neither an entry nor a stray temp dir
    again = TokenizedCorpus.build(src, tok, cache)
    assert not again.cache_hit and again.doc(0).tolist() == list(b"hello")


def test_losing_a_publish_race_keeps_the_winners_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = folder(tmp_path, {"a.txt": b"hello"})
    src, tok = TextFolderSource(root), ByteTokenizer()
    key = cache_key(src, tok)
    TokenizedCorpus.build(src, tok, tmp_path / "elsewhere")

    def another_rank_publishes_first(tmp: str, final: str) -> None:
        shutil.copytree(tmp_path / "elsewhere" / key, final)
        raise OSError(errno.ENOTEMPTY, "Directory not empty", final)

    monkeypatch.setattr(os, "replace", another_rank_publishes_first)
    corpus = TokenizedCorpus.build(src, tok, tmp_path / "cache")
    assert corpus.doc(0).tolist() == list(b"hello")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [key]  # our temp dir is gone


def test_half_written_or_truncated_entry_is_rebuilt_not_trusted(tmp_path: Path) -> None:
    root = folder(tmp_path, {"a.txt": b"hello", "b.txt": b"world!"})
    cache = tmp_path / "cache"
    src, tok = TextFolderSource(root), ByteTokenizer()
    good = TokenizedCorpus.build(src, tok, cache)
    entry = cache / cache_key(src, tok)
    with open(entry / "tokens.bin", "r+b") as fh:  # a torn write: the file lost its tail
        fh.truncate(7)
    with pytest.raises(DataError, match="tokens file has 7 bytes, expected 22"):
        TokenizedCorpus.open(entry)
    rebuilt = TokenizedCorpus.build(src, tok, cache)
    assert not rebuilt.cache_hit and rebuilt.lengths.tolist() == good.lengths.tolist() == [5, 6]
    (entry / "meta.json").unlink()  # a directory without its meta is never read
    with pytest.raises(DataError, match="not a valid token cache entry"):
        TokenizedCorpus.open(entry)
    assert not TokenizedCorpus.build(src, tok, cache).cache_hit


def test_cache_with_hf_tokenizer_and_skipped_records(tmp_path: Path) -> None:
    tok = HFTokenizer(make_hf_tokenizer_file(tmp_path / "tokenizer.json"))
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(
        data / "a.jsonl", ['{"text": "hello world"}', "oops", '{"text": "   "}', '{"text": "café"}']
    )
    corpus = TokenizedCorpus.build(JsonlSource(data, on_bad_record="skip"), tok, tmp_path / "cache")
    assert [corpus.doc(i).tolist() for i in range(len(corpus))] == [[2, 3], [4]]
    assert corpus.stats.bad_records_skipped == 1 and corpus.stats.empty_after_tokenization == 1
    hit = TokenizedCorpus.build(JsonlSource(data, on_bad_record="skip"), tok, tmp_path / "cache")
    assert hit.cache_hit and hit.stats == corpus.stats


def test_default_cache_dir_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = folder(tmp_path, {"a.txt": b"abc"})
    monkeypatch.setenv("HOTSPA_CACHE_DIR", str(tmp_path / "envcache"))
    corpus = TokenizedCorpus.build(TextFolderSource(root), ByteTokenizer())
    assert corpus.path is not None and corpus.path.parent == tmp_path / "envcache"
    meta = json.loads((corpus.path / "meta.json").read_text())
    assert meta["num_tokens"] == 3 and meta["key"] == corpus.key


def test_synthetic_source_through_the_cache_keeps_lengths(tmp_path: Path) -> None:
    gen = LengthGenerator(kind="commoncrawl", seed=5)
    corpus = TokenizedCorpus.build(SyntheticSource(50, gen), ByteTokenizer(), tmp_path)
    assert corpus.lengths.tolist() == gen.lengths(50).tolist()
