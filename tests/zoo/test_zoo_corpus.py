from __future__ import annotations

from pathlib import Path

import pytest

from kiln.zoo import corpus


def test_split_is_a_stable_hash_of_the_path():
    # Fixed answers: the split must not change across runs, machines or Python versions
    # (Python's own hash() is salted per process, sha256 is not).
    assert corpus.is_heldout("chunk.py")
    assert corpus.is_heldout("json/__init__.py") is False
    assert corpus.is_heldout("copyreg.py")
    assert [corpus.is_heldout(p) for p in ("os.py", "os.py")] == [False, False]


def test_stdlib_split_is_disjoint_sorted_and_about_five_percent():
    train = corpus.list_files(split="train")
    heldout = corpus.list_files(split="heldout")
    every = corpus.list_files(split="all")
    assert train == sorted(train) and heldout == sorted(heldout)
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == every
    assert len(every) > 500, "the running interpreter's stdlib looks incomplete"
    assert 0.03 < len(heldout) / len(every) < 0.08
    assert not any("site-packages" in p for p in every)
    assert "os.py" in train


def test_corpus_root_excludes_third_party_and_reads_in_order(tmp_path: Path):
    for rel in ("b.py", "a/x.py", "site-packages/pkg/mod.py", "a/notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n")
    (tmp_path / "bad.py").write_bytes(b"x = '\xff'\n")  # not UTF-8: kept, bytes replaced
    assert corpus.list_files(tmp_path) == ["a/x.py", "b.py", "bad.py"]
    files = corpus.read_files("all", root=tmp_path, max_files=2)
    assert [f.rel_path for f in files] == ["a/x.py", "b.py"]
    assert files[0].text == "# a/x.py\n"
    assert "\ufffd" in corpus.read_files("all", root=tmp_path)[2].text


def test_bad_split_and_root_are_reported(tmp_path: Path):
    with pytest.raises(ValueError, match="valid: train, heldout, all"):
        corpus.list_files(tmp_path, split="test")  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match="not a directory"):
        corpus.list_files(tmp_path / "missing")


def test_encode_files_wraps_each_file_in_bos_and_eos():
    class Enc:
        def __init__(self, ids):
            self.ids = ids

    class FakeTokenizer:
        def encode_batch(self, texts, add_special_tokens=True):
            assert add_special_tokens is False
            return [Enc([len(t)] * 2) for t in texts]

    files = [corpus.SourceFile("a.py", "abc"), corpus.SourceFile("b.py", "de")]
    stream = corpus.encode_files(FakeTokenizer(), files, bos_id=1, eos_id=2)
    assert stream.tolist() == [1, 3, 3, 2, 1, 2, 2, 2]
