"""Side files: the rest of a model folder is carried into the output, safely, as the plan says."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import weightmap
from weightmap.errors import CheckpointError, ExecutionError, MappingError
from weightmap.inputs.sidefiles import list_side_files
from weightmap.plan.plan import Plan

KEEP_ALL = "weightmap 1\nunmatched keep\n"


def _folder(tmp_path: Path, example: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(example, src)
    (src / "README.md").write_text("# a model\n")
    (src / "tokenizer.json").write_text('{"version": "1.0"}\n')
    (src / "generation_config.json").write_text('{"do_sample": false}\n')
    (src / "tokenizer").mkdir()
    (src / "tokenizer" / "vocab.json").write_text("{}\n")
    # Not carried: weights in any format, their indexes, hidden files and folders.
    (src / "pytorch_model.bin").write_bytes(b"old weights")
    (src / "consolidated.safetensors").write_bytes(b"old weights")
    (src / "pytorch_model.bin.index.json").write_text("{}")
    (src / ".gitattributes").write_text("*.bin filter=lfs\n")
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return src


CARRIED = {"README.md", "generation_config.json", "tokenizer.json", "tokenizer/vocab.json"}


def test_every_other_regular_file_is_carried_byte_for_byte(tmp_path: Path, example: Path) -> None:
    src = _folder(tmp_path, example)
    result = weightmap.remap(src, tmp_path / "out", mapping=KEEP_ALL, verify=True, progress=False)
    out = tmp_path / "out"
    found = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert found == CARRIED | {"config.json", "model.safetensors"}
    for name in CARRIED:
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert {f.name for f in result.plan.files} == CARRIED
    assert {out / n for n in CARRIED} <= set(result.paths)
    # The plan says so: explain() and the JSON list them, and the JSON reads back.
    text = result.plan.explain()
    assert "side files: 4" in text and "file tokenizer/vocab.json  3 bytes, carried" in text
    doc = json.loads(result.plan.to_json())
    assert {f["name"] for f in doc["files"]} == CARRIED
    assert Plan.from_json(result.plan.to_json()) == result.plan
    # verify() checks them too: against the input folder, byte for byte.
    assert weightmap.verify(out, result.plan, source=src) == []
    (out / "README.md").write_text("# another\n")
    assert weightmap.verify(out, result.plan, source=src) == [
        "side file 'README.md' differs from 'README.md' in the input"
    ]


def test_links_and_special_files_are_handled_safely(tmp_path: Path, example: Path) -> None:
    src = _folder(tmp_path, example)
    secret = tmp_path / "secret.txt"
    secret.write_text("outside\n")
    (src / "tokenizer_config.json").symlink_to("tokenizer.json")  # inside: copied as a file
    (src / "leak.txt").symlink_to(secret)  # leaves the folder: skipped
    (src / "dangling.txt").symlink_to(tmp_path / "nothing")
    (src / "linked_dir").symlink_to(src / "tokenizer")
    os.mkfifo(src / "pipe")
    files = list_side_files(src)
    assert {f.name for f in files.files} == CARRIED | {"tokenizer_config.json"}
    assert sorted(files.skipped) == [
        "side file 'dangling.txt' is not carried: it is a link to nothing",
        f"side file 'leak.txt' is not carried: it is a link that leaves the folder (to {secret})",
        "side file 'linked_dir' is not carried: it is a link to a folder (links to folders are "
        "not followed)",
        "side file 'pipe' is not carried: it is a FIFO, not a regular file",
    ]
    result = weightmap.remap(src, tmp_path / "out", mapping=KEEP_ALL, progress=False)
    copied = tmp_path / "out" / "tokenizer_config.json"
    assert not copied.is_symlink() and copied.read_text() == '{"version": "1.0"}\n'
    assert len([w for w in result.plan.warnings if "is not carried" in w]) == 4


def test_hub_cache_links_into_blobs_are_followed(tmp_path: Path, example: Path) -> None:
    repo = tmp_path / "models--org--name"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for name in ("model.safetensors", "config.json"):
        (repo / "blobs" / name.upper()).write_bytes((example / name).read_bytes())
        (snap / name).symlink_to(Path("..", "..", "blobs", name.upper()))
    (repo / "blobs" / "tok").write_text("{}")
    (snap / "tokenizer").mkdir()
    (snap / "tokenizer" / "tokenizer.json").symlink_to(Path("..", "..", "..", "blobs", "tok"))
    files = list_side_files(snap)
    assert [f.name for f in files.files] == ["tokenizer/tokenizer.json"] and not files.skipped


def test_output_inside_the_input_folder_is_not_carried(tmp_path: Path, example: Path) -> None:
    src = _folder(tmp_path, example)
    result = weightmap.remap(src, src / "converted", mapping=KEEP_ALL, progress=False)
    assert not any(f.name.startswith("converted") for f in result.plan.files)


@pytest.mark.parametrize("dest", ["tokenizer", "converted", "link"])
def test_an_existing_folder_inside_the_input_is_never_replaced(
    tmp_path: Path, example: Path, dest: str
) -> None:
    # What it holds is part of the input (the tokenizer folder, an old output the user may
    # still want): left out of the side files because it is the destination, and replacing
    # it would delete it. A link in the folder is part of it too, wherever it points.
    src = _folder(tmp_path, example)
    weightmap.remap(src, src / "converted", mapping=KEEP_ALL, progress=False)
    (tmp_path / "elsewhere").mkdir()
    (src / "link").symlink_to(tmp_path / "elsewhere")
    before = {p: p.read_bytes() for p in src.rglob("*") if p.is_file()}
    with pytest.raises(weightmap.OutputExistsError, match="inside the input folder"):
        weightmap.remap(src, src / dest, mapping=KEEP_ALL, overwrite=True, progress=False)
    assert {p: p.read_bytes() for p in src.rglob("*") if p.is_file()} == before
    assert (src / "link").is_symlink()


def test_a_link_is_no_way_around_the_listing(tmp_path: Path, example: Path) -> None:
    # A link inside the folder to a file the listing leaves out is not followed: a remote's
    # URL in .git/config can hold a token, and the weights are the unconverted tensors.
    src = _folder(tmp_path, example)
    (src / ".git" / "config").write_text("url = https://user:hf_abcdefghijkl@example.com/m\n")
    (src / "notes.txt").symlink_to(Path(".git", "config"))
    (src / "weights.txt").symlink_to("pytorch_model.bin")
    (src / "cfg.txt").symlink_to("config.json")
    files = list_side_files(src)
    assert {f.name for f in files.files} == CARRIED
    assert sorted(files.skipped) == [
        "side file 'cfg.txt' is not carried: it is a link to 'config.json', the config, which "
        "is not carried under its own name either",
        "side file 'notes.txt' is not carried: it is a link to '.git/config', a hidden file, "
        "which is not carried under its own name either",
        "side file 'weights.txt' is not carried: it is a link to 'pytorch_model.bin', weights, "
        "which is not carried under its own name either",
    ]
    weightmap.remap(src, tmp_path / "out", mapping=KEEP_ALL, progress=False)
    assert not (tmp_path / "out" / "notes.txt").exists()


def test_a_link_repointed_at_a_hidden_file_after_planning_is_refused(
    tmp_path: Path, example: Path
) -> None:
    src = _folder(tmp_path, example)
    (src / "notes.txt").symlink_to("README.md")

    def repoint(plan: Plan) -> None:
        assert "notes.txt" in {f.name for f in plan.files}
        (src / "notes.txt").unlink()
        (src / ".git" / "config").write_text("# a model\n")  # the planned size
        (src / "notes.txt").symlink_to(Path(".git", "config"))

    with pytest.raises(CheckpointError, match=r"a hidden file.*\[changed\]"):
        weightmap.remap(src, tmp_path / "out", mapping=KEEP_ALL, progress=False, on_plan=repoint)
    assert not (tmp_path / "out").exists()


def test_files_block_drops_renames_and_adds(tmp_path: Path, example: Path) -> None:
    src = _folder(tmp_path, example)
    mapping = """weightmap 1
param greedy = true
unmatched keep
files {
    drop "*.md"
    rename "tokenizer/{f}" -> "tok/{f}"
    add "generation_config.json.new" = {"do_sample": not greedy}
    add "NOTICE" = "converted\\n"
}
"""
    result = weightmap.remap(src, tmp_path / "out", mapping=mapping, verify=True, progress=False)
    out = tmp_path / "out"
    assert {f.name for f in result.plan.files} == {
        "NOTICE",
        "generation_config.json",
        "generation_config.json.new",
        "tok/vocab.json",
        "tokenizer.json",
    }
    assert (out / "NOTICE").read_text() == "converted\n"
    assert json.loads((out / "generation_config.json.new").read_text()) == {"do_sample": False}
    assert (out / "tok" / "vocab.json").read_text() == "{}\n" and not (out / "README.md").exists()
    assert "file tok/vocab.json  3 bytes, from tokenizer/vocab.json (<string>:6:5)" in (
        result.plan.explain()
    )


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ('drop "LICENSE"', 'pattern "LICENSE" matches no side file (write `drop?` if that is '),
        ('drop "READMe.md"', "did you mean 'README.md'?"),
        ('rename "README.md" -> "config.json"', "is written by the conversion itself"),
        # A folder under such a name could not be made beside that file: refused when
        # planning, not once every tensor is written.
        ('add "config.json/x.txt" = "x"', "is inside a folder named 'config.json', the name"),
        ('rename "README.md" -> "model.safetensors/README.md"', "folder named 'model.safetensors'"),
        ('add "a/model.safetensors.index.json/x" = "x"', "named 'a/model.safetensors.index.json'"),
        ('rename "README.md" -> "../README.md"', "has an empty, `.` or `..` component"),
        (
            'rename "*.json" -> "same.json"',
            "'same.json' (renamed from 'tokenizer.json') is already",
        ),
        ('add "README.md" = "x"', "'README.md' (added) is already a side file; drop it first"),
        ('add "tokenizer" = "x"', "'tokenizer' is both a file and a folder"),
        # A lone surrogate cannot be written as UTF-8: refused when planning, not after the
        # tensors are written.
        ('add "x\\ud800" = "x"', "(added) holds a lone surrogate escape"),
        ('add "x" = "a\\udfff"', "the value of 'x' holds a lone surrogate, which is not UTF-8"),
        ('add "x.json" = {"k": "\\ud800"}', "the value of 'x.json' holds a lone surrogate at `k`"),
        ('rename "README.{e}" -> "R\\ud800.{e}"', "(renamed from 'README.md') holds a lone"),
    ],
)
def test_files_block_problems(tmp_path: Path, example: Path, files: str, message: str) -> None:
    src = _folder(tmp_path, example)
    mapping = f"weightmap 1\nunmatched keep\nfiles {{\n    {files}\n}}\n"
    with pytest.raises(MappingError) as info:
        weightmap.compile(src, mapping=mapping)
    assert message in str(info.value)


def test_exists_file_and_no_side_files(tmp_path: Path, example: Path) -> None:
    src = _folder(tmp_path, example)
    mapping = """weightmap 1
unmatched keep
warn if exists file "tokenizer/*.json" "has a tokenizer folder"
files {
    drop "README.md"
}
"""
    plan = weightmap.compile(src, mapping=mapping)
    assert plan.warnings == ("<string>:3:1: has a tokenizer folder",)
    # Off: nothing is carried, no files block applies, and `exists file` is false.
    plan = weightmap.compile(src, mapping=mapping, side_files=False)
    assert plan.files == () and plan.warnings == ()
    # A file given alone carries nothing: its folder may be any folder.
    assert weightmap.compile(src / "model.safetensors", mapping=mapping).files == ()


def test_cli_no_side_files(tmp_path: Path, example: Path) -> None:
    src = _folder(tmp_path, example)
    cmd = [sys.executable, "-m", "weightmap", "convert", str(src), str(tmp_path / "out")]
    r = subprocess.run(
        [*cmd, "--preset", "eagle3-sglang", "--no-side-files"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "weightmap", "plan", str(src), "--preset", "eagle3-sglang"],
        capture_output=True,
        text=True,
    )
    assert "; 4 side file(s)" in r.stdout and "file tokenizer.json" in r.stdout


def test_a_side_file_that_changes_is_refused(tmp_path: Path, example: Path) -> None:
    src = _folder(tmp_path, example)

    def grow(plan: Plan) -> None:
        with (src / "README.md").open("a") as f:
            f.write("more\n")

    with pytest.raises(CheckpointError, match=r"'README.md' changed since the plan was made"):
        weightmap.remap(src, tmp_path / "out", mapping=KEEP_ALL, progress=False, on_plan=grow)
    assert not (tmp_path / "out").exists()


def test_verify_catches_a_bad_copy(
    tmp_path: Path, example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _folder(tmp_path, example)
    import weightmap.execute.sidefiles as sidefiles

    def bad_copy(src_fd: int, dst: Path, size: int, *_: object) -> None:
        dst.write_bytes(b"x" * size)

    monkeypatch.setattr(sidefiles, "copy_file", bad_copy)
    with pytest.raises(ExecutionError, match=r"side file 'README\.md' differs from 'README\.md'"):
        weightmap.remap(src, tmp_path / "out", mapping=KEEP_ALL, verify=True, progress=False)
    assert not (tmp_path / "out").exists()


def test_large_side_files_are_copied_in_the_kernel(
    tmp_path: Path, example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _folder(tmp_path, example)
    big = src / "tokenizer.model"
    big.write_bytes(b"\x01" * (64 * 2**20))  # data, not a hole: holes are not copied at all
    calls: list[int] = []
    real = os.copy_file_range

    def counted(src_fd: int, dst_fd: int, count: int, *args: int) -> int:
        calls.append(count)
        return real(src_fd, dst_fd, count, *args)

    monkeypatch.setattr(os, "copy_file_range", counted)
    weightmap.remap(src, tmp_path / "out", mapping=KEEP_ALL, progress=False)
    assert (tmp_path / "out" / "tokenizer.model").stat().st_size == 64 * 2**20
    assert sum(calls) >= 64 * 2**20  # the big file went through the kernel copy


def test_reverse_eagle3_restores_auto_map_where_config_py_is_carried(
    tmp_path: Path, example: Path
) -> None:
    src = tmp_path / "speculators"
    shutil.copytree(example, src)
    weightmap.remap(src, tmp_path / "sglang", preset="eagle3-sglang", progress=False)
    params = {"verifier": "org/verifier"}
    back = weightmap.remap(
        tmp_path / "sglang",
        tmp_path / "back",
        preset="eagle3-speculators",
        params=params,
        progress=False,
    )
    assert "auto_map" not in json.loads((tmp_path / "back" / "config.json").read_text())
    assert any("no config.py among the side files" in w for w in back.plan.warnings)

    (src / "config.py").write_text("class Eagle3SpeculatorConfig: ...\n")
    weightmap.remap(
        src, tmp_path / "sglang", preset="eagle3-sglang", overwrite=True, progress=False
    )
    assert (tmp_path / "sglang" / "config.py").exists()
    back = weightmap.remap(
        tmp_path / "sglang",
        tmp_path / "back",
        preset="eagle3-speculators",
        params=params,
        overwrite=True,
        progress=False,
    )
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["auto_map"] == {"": "config.Eagle3SpeculatorConfig"}
    assert (tmp_path / "back" / "config.py").read_text() == (src / "config.py").read_text()
    assert not any("config.py" in w for w in back.plan.warnings)


def test_a_folder_swapped_for_a_link_while_opening_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between resolving a side file's path and opening it, a folder on the way swapped for a
    link to a folder outside (holding a file of the same name and size) must not be read:
    the open walks the resolved path without following any link."""
    from weightmap.inputs.sidefiles import open_side_file

    root = tmp_path / "ckpt"
    (root / "tok").mkdir(parents=True)
    (root / "tok" / "vocab.json").write_text('{"a": 1}')
    outside = tmp_path / "home"
    outside.mkdir()
    (outside / "vocab.json").write_text('{"s": 9}')  # same size, other bytes
    fd = open_side_file(root, "tok/vocab.json", 8)
    assert os.read(fd, 100) == b'{"a": 1}'
    os.close(fd)

    real_resolve = Path.resolve

    def resolve_then_swap(self: Path, strict: bool = False) -> Path:
        found = real_resolve(self, strict)
        if found.name == "vocab.json" and not (root / "tok").is_symlink():
            (root / "tok").rename(tmp_path / "tok-moved")
            (root / "tok").symlink_to(outside)
        return found

    monkeypatch.setattr(Path, "resolve", resolve_then_swap)
    with pytest.raises(CheckpointError, match=r"cannot be opened .*\[changed\]"):
        open_side_file(root, "tok/vocab.json", 8)
