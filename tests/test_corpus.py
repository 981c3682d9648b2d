"""The default model's training corpus (deltaserve/tools/corpus.py): generated tables left out, packages only under
the licences it takes and recorded, held-out files never trained on."""

import importlib.metadata

import pytest

from deltaserve.tools import corpus


@pytest.fixture(scope="module")
def training():
    return corpus.training_documents()


def _stdlib_text(rel: str) -> str:
    return corpus._read(corpus.stdlib_dir() / rel)


@pytest.mark.parametrize("rel", ["encodings/cp1252.py", "encodings/mac_roman.py", "html/entities.py",
                                 "pydoc_data/topics.py", "encodings/aliases.py", "stringprep.py"])
def test_generated_tables_are_left_out(rel, training):
    text = _stdlib_text(rel)
    assert corpus.is_table(text)
    assert text not in training


@pytest.mark.parametrize("rel", ["os.py", "json/__init__.py", "_pydecimal.py", "encodings/utf_8.py", "keyword.py"])
def test_code_is_kept(rel):
    """Code, however many strings it holds, is not a table (keyword.py is a list, but a short one)."""
    assert not corpus.is_table(_stdlib_text(rel))


def test_packages_are_recorded_with_their_licences(training):
    m = corpus.manifest()
    assert [p["name"] for p in m["packages"]] == list(corpus.PACKAGES)
    for p in m["packages"]:
        assert p["version"] == importlib.metadata.version(p["name"]) and p["files"] > 0 and p["bytes"] > 0
        assert all(part.strip("() ") in corpus.ALLOWED_LICENCES
                   for part in p["licence"].replace(" OR ", " AND ").split(" AND "))
    assert sum(p["bytes"] for p in m["packages"]) < sum(len(t.encode()) for t in training)
    with pytest.raises(ValueError, match="tqdm"):  # MPL-2.0 AND MIT: not every part is one the corpus takes
        corpus.package_licence("tqdm")


def test_vendored_copies_and_tests_are_not_package_files():
    rels = [rel for rel, _ in corpus.package_files("pip")]
    assert rels and not any("/_vendor/" in r for r in rels)
    assert all(r.startswith("site-packages/pip/") for r in rels)


def test_held_out_files_never_train(training):
    """Every file of the validation text is held out, and none of the held-out files' texts is trained on."""
    text = corpus.build_validation_text()
    heads = [line[2:] for line in text.splitlines() if line.startswith("# ") and line.endswith(".py")]
    listed = dict(corpus.stdlib_files())
    held = [rel for rel in heads if rel in listed]
    assert len(held) > 10 and all(corpus.is_validation(rel) for rel in held)
    trained = set(training)
    for rel, p in corpus.corpus_files():
        if corpus.is_validation(rel):
            assert corpus._read(p) not in trained, rel


def test_second_held_out_set_is_cpython_tests_never_trained():
    """The shipped second held-out text is whole files of CPython's test suite picked by their path's hash, and the
    corpus never lists a file of that folder."""
    import hashlib

    shipped = corpus.test_suite_text()
    heads = [line[2:] for line in shipped.splitlines() if line.startswith("# test/") and line.endswith(".py")]
    assert len(heads) > 10
    assert all(int(hashlib.sha1(h.encode()).hexdigest(), 16) % corpus.TEST_SUITE_BUCKETS == 0 for h in heads)
    test_dir = corpus.stdlib_dir() / "test"
    assert not any(p.is_relative_to(test_dir) for _, p in corpus.corpus_files())
    for h in heads[:5]:  # each file whole, as the installed Python has it (when it has the file)
        p = test_dir / h.removeprefix("test/")
        if p.exists():
            assert f"# {h}\n{corpus._read(p)}" in shipped


def test_extra_packages_bring_their_tests_within_the_cap(monkeypatch):
    """An extended-corpus package gives its files tests included, never a held-out one, at most EXTRA_MAX_BYTES."""
    files = [rel for rel, _ in corpus.package_files("fsspec", with_tests=True)]
    assert any(corpus.is_validation(rel) for rel in files) and any("/tests/" in rel for rel in files)
    texts = corpus.extra_package_texts("fsspec")
    rels = [rel for rel, _ in texts]
    assert any("/tests/" in rel for rel in rels) and not any(corpus.is_validation(rel) for rel in rels)
    assert sum(len(t.encode()) for _, t in texts) <= corpus.EXTRA_MAX_BYTES
    monkeypatch.setattr(corpus, "EXTRA_MAX_BYTES", 100_000)
    capped = corpus.extra_package_texts("fsspec")
    assert 0 < sum(len(t.encode()) for _, t in capped) <= 100_000 and set(capped) < set(texts)


def test_extended_corpus_is_the_core_then_the_extra_packages(monkeypatch, training):
    monkeypatch.setattr(corpus, "EXTRA_PACKAGES", ("fsspec",))
    extra = corpus.extra_package_texts("fsspec")
    assert corpus.training_documents("extended") == training + [text for _, text in extra]
    m = corpus.manifest("extended")
    assert m["corpus"] == "extended" and [p["name"] for p in m["packages"]] == [*corpus.PACKAGES, "fsspec"]
    assert m["packages"][-1]["tests"] and not m["packages"][0]["tests"]
    assert m["packages"][-1]["files"] == len(extra)
    with pytest.raises(ValueError, match="unknown corpus"):
        corpus.training_documents("everything")
