"""Adapter references, names, file-list checks and the stored manifest form (pure logic)."""

from __future__ import annotations

import pytest

from preft.adapters import AdapterMethod, adapter_digest, content_digest, file_sha256
from preft.common.errors import InvalidArgument, ResourceExhausted
from preft.common.refs import AdapterRef, check_name
from preft.registry.model import FileEntry, Manifest, PositionMode
from preft.registry.validation import check_files


@pytest.mark.parametrize(
    ("text", "owner", "name", "version", "alias"),
    [
        ("chat", None, "chat", None, "latest"),
        ("chat@v3", None, "chat", 3, None),
        ("chat@3", None, "chat", 3, None),
        ("chat:prod", None, "chat", None, "prod"),
        ("acme/chat", "acme", "chat", None, "latest"),
        ("acme/chat@v12", "acme", "chat", 12, None),
        ("acme/my-adapter_2.1:canary", "acme", "my-adapter_2.1", None, "canary"),
    ],
)
def test_reference_forms(text, owner, name, version, alias):
    ref = AdapterRef.parse(text)
    assert (ref.owner, ref.name, ref.version, ref.alias) == (owner, name, version, alias)
    assert AdapterRef.parse(str(ref)) == ref


@pytest.mark.parametrize(
    "text",
    ["", "Chat", "chat@v0", "chat@vx", "chat:", "a/b/c", "../chat", "chat:pr..od", "-chat", "chat@v1:prod", " x"],
)
def test_bad_references(text):
    with pytest.raises(InvalidArgument, match="reference"):
        AdapterRef.parse(text)


@pytest.mark.parametrize("name", ["", "A", "a b", "a/b", "..", "a..b", "x" * 64, "é"])
def test_bad_names(name):
    with pytest.raises(InvalidArgument, match="not a valid name"):
        check_name(name, "tenant id")


def test_owned_by_fills_in_only_a_missing_owner():
    assert AdapterRef.parse("chat").owned_by("acme").owner == "acme"
    assert AdapterRef.parse("beta/chat").owned_by("acme").owner == "beta"


def _entry(path: str, size: int = 10) -> FileEntry:
    return FileEntry(path, "ab" * 32, size)


@pytest.mark.parametrize(
    ("files", "error", "words"),
    [
        ([], InvalidArgument, "needs files"),
        ([_entry("../adapter_config.json")], InvalidArgument, "plain file names"),
        ([_entry("sub\\adapter_config.json")], InvalidArgument, "plain file names"),
        ([_entry(".hidden")], InvalidArgument, "plain file names"),
        ([_entry("adapter_model.bin")], InvalidArgument, "pickled"),
        ([_entry("weights.pt")], InvalidArgument, "pickled"),
        ([_entry("train.py")], InvalidArgument, "allowed files"),
        ([_entry("README.md"), _entry("README.md")], InvalidArgument, "twice"),
        ([FileEntry("README.md", "XYZ", 1)], InvalidArgument, "sha256"),
        ([_entry("adapter_config.json", 2000)], ResourceExhausted, "limit"),
        ([_entry("adapter_model.safetensors", 6000)], ResourceExhausted, "adapter limit"),
    ],
)
def test_file_list_checks(files, error, words):
    with pytest.raises(error, match=words):
        check_files(files, max_adapter_bytes=5000, max_config_bytes=1000)


def test_readme_does_not_change_the_content_digest(tmp_path):
    d = tmp_path / "a"
    d.mkdir()
    (d / "adapter_config.json").write_text("{}")
    (d / "adapter_model.safetensors").write_bytes(b"weights")
    before = adapter_digest(d)
    (d / "README.md").write_text("# notes")
    assert adapter_digest(d) == before
    assert before == content_digest({p.name: file_sha256(p) for p in d.iterdir()})


def test_manifest_round_trips_through_its_stored_form():
    m = Manifest(
        tenant="acme",
        name="chat",
        version=3,
        digest="d" * 64,
        method=AdapterMethod.DIREFT,
        default_mode=PositionMode.ALL,
        rank=4,
        target_modules=(),
        layers=(0, 2),
        base_model="tiny",
        base_model_digest="b" * 64,
        size_bytes=123,
        files=(FileEntry("adapter_model.safetensors", "a" * 64, 100), FileEntry("preft_config.json", "c" * 64, 23)),
        created_unix_ms=1_790_000_000_000,
        uploader="ops",
    )
    assert Manifest.from_json("acme", "chat", 3, m.to_json()) == m
    assert m.ref == "acme/chat@v3"
