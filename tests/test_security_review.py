"""Regressions from a hostile review of issue 33's changes (docs/safety.md): the one work
budget also pays for matching side-file patterns, and a side file is copied only at the size
that was checked."""

from __future__ import annotations

import errno
import os
import shutil
import threading
from pathlib import Path

import pytest

import weightmap
import weightmap.compiler.compile as compile_mod
import weightmap.execute.inplace as inplace
import weightmap.execute.sidefiles as exec_sidefiles
from weightmap.errors import CheckpointError, ExecutionError, FormatError, MappingError
from weightmap.format.header import read_header
from weightmap.inputs.sidefiles import data_ranges

KEEP_ALL = "weightmap 1\nunmatched keep\n"
RENAME = 'weightmap 1\nrename "layers.0.{rest*}" -> "midlayer.{rest}"\nunmatched keep\n'


@pytest.fixture
def ckpt(tmp_path: Path, example: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(example, root)
    return root


def _many_files(root: Path, count: int) -> None:
    (root / "d").mkdir()
    for i in range(count):
        (root / "d" / f"f{i:05d}.txt").write_text("x")


# -- the work budget: files statements pay for the side files they try ---------------------------


def test_exists_file_in_a_comprehension_walks_the_side_files_once(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each `exists file` walks every side file (up to 10,000) and was charged as one value:
    # 100,000 of them in a comprehension cost 10**9 matches from a 90-byte mapping.
    calls: list[object] = []
    real = compile_mod.file_exists

    def counting(files: object, pattern: object) -> bool:
        calls.append(pattern)
        return real(files, pattern)  # type: ignore[arg-type]

    monkeypatch.setattr(compile_mod, "file_exists", counting)
    mapping = KEEP_ALL + 'warn if len([1 for i in [0] * 500 if exists file "zz*"]) > 0 "x"\n'
    weightmap.compile(ckpt, mapping=mapping)
    assert len(calls) == 1


def test_drop_patterns_spend_the_mappings_one_budget(ckpt: Path) -> None:
    # 501 statements tried on 2,000 side files are 1,002,000 matches: past the 1,000,000
    # units a mapping may spend. Each statement used to be free, so a 1 MB mapping of them on
    # a 10,000-file folder matched for hours.
    _many_files(ckpt, 2000)
    stmts = "\n".join(f'    drop? "zz{i}*"' for i in range(501))
    with pytest.raises(MappingError) as info:
        weightmap.compile(ckpt, mapping=f"{KEEP_ALL}files {{\n{stmts}\n}}\n")
    text = str(info.value)
    assert "(1 problem)" in text
    assert "files: the mapping's work budget (1,000,000 units" in text
    assert "(2,000 here)" in text


def test_a_close_match_hint_is_paid_for_too(ckpt: Path) -> None:
    # difflib compares the pattern with every side file, at about twenty matches' cost each:
    # 30 patterns that match nothing on 2,000 files spend more than the budget.
    _many_files(ckpt, 2000)
    stmts = "\n".join(f'    drop "zz{i}*"' for i in range(30))
    with pytest.raises(MappingError) as info:
        weightmap.compile(ckpt, mapping=f"{KEEP_ALL}files {{\n{stmts}\n}}\n")
    assert "files: the mapping's work budget" in str(info.value)


def test_a_few_statements_on_a_large_folder_are_within_budget(ckpt: Path) -> None:
    _many_files(ckpt, 2000)
    stmts = '    drop "d/f0000*.txt"\n    rename "d/{f}.txt" -> "e/{f}"\n'
    mapping = f"{KEEP_ALL}files {{\n{stmts}}}\n"
    plan = weightmap.compile(ckpt, mapping=mapping)
    names = {f.name for f in plan.files}
    assert "e/f01999" in names and "d/f00001.txt" not in names


# -- names: compared as Windows and macOS compare them --------------------------------------------


@pytest.mark.parametrize(
    "name", ["Config.json", "CONFIG.JSON", "config.json.", "Model.SafeTensors."]
)
def test_a_mapping_cannot_add_the_config_under_a_folded_name(ckpt: Path, name: str) -> None:
    # Beside the config.json the conversion writes, a copy of the output on Windows or macOS
    # keeps one of the two: maybe the mapping's, whose text the plan's config diff never shows.
    mapping = f'{KEEP_ALL}files {{\n    add "{name}" = {{"auto_map": {{}}}}\n}}\n'
    with pytest.raises(MappingError) as info:
        weightmap.compile(ckpt, mapping=mapping)
    assert f"side file name {name!r} (added) is " in str(info.value)
    assert "a file the conversion writes itself" in str(info.value)


def test_names_that_differ_only_in_case_are_refused(ckpt: Path) -> None:
    (ckpt / "README.md").write_text("# the model\n")
    mapping = f'{KEEP_ALL}files {{\n    add "readme.MD " = "# another"\n}}\n'
    with pytest.raises(MappingError) as info:
        weightmap.compile(ckpt, mapping=mapping)
    assert "<string>:4:5: files: 'README.md', 'readme.MD ' differ only in case" in str(info.value)
    # A subfolder's config.json, and the input's own names, are no clash.
    (ckpt / "Notes.txt").write_text("a")
    (ckpt / "notes.txt").write_text("b")
    plan = weightmap.compile(
        ckpt, mapping=f'{KEEP_ALL}files {{\n    add "tok/Config.json" = {{}}\n}}\n'
    )
    assert {"Notes.txt", "notes.txt", "tok/Config.json"} <= {f.name for f in plan.files}


# -- side files: copied at the size that was checked ----------------------------------------------


def test_a_side_file_grown_after_its_open_is_refused(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The copy compared the file's state after it with the state before it, but not that state
    # with the plan's size: a file appended to between its open and the copy came out cut to
    # its planned prefix, with exit 0.
    side = ckpt / "notes.txt"
    side.write_bytes(b"a" * 10_000)
    real = exec_sidefiles.open_side_file

    def opening(root: Path, name: str, size: int) -> int:
        fd = real(root, name, size)
        if name == "notes.txt":
            with side.open("ab") as f:
                f.write(b"appended")
        return fd

    monkeypatch.setattr(exec_sidefiles, "open_side_file", opening)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"changed before it was copied.*\[changed\]"):
        weightmap.remap(ckpt, out, mapping=KEEP_ALL, progress=False)
    assert not out.exists()


def test_a_file_cut_between_seek_data_and_seek_hole_ends_the_ranges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SEEK_HOLE past the end (the file cut since SEEK_DATA found data) raised ENXIO out of
    # the copy as a bare OSError; the ranges now end there, and the state check after the
    # copy names the change.
    path = tmp_path / "f"
    path.write_bytes(b"x" * 8192)
    real = os.lseek

    def lseek(fd: int, pos: int, how: int) -> int:
        if how == os.SEEK_HOLE:
            raise OSError(errno.ENXIO, os.strerror(errno.ENXIO))
        return real(fd, pos, how)

    monkeypatch.setattr(os, "lseek", lseek)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert data_ranges(fd, 8192) == []
    finally:
        os.close(fd)


# -- in place: the index rewritten is the one that was checked -----------------------------------


def test_an_inplace_rename_never_rewrites_a_swapped_index(
    tmp_path: Path, example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The in-place rename read the index again by name (following links, unbounded, blocking
    # on a FIFO) and wrote it back with the new weight map: a racer in a shared folder who
    # swapped it for a link to a credentials file got the file's JSON written into the folder.
    root = tmp_path / "sharded"
    weightmap.remap(example, root, mapping=KEEP_ALL, max_shard_size="64KB", progress=False)
    index = root / "model.safetensors.index.json"
    secret = tmp_path / "home" / ".docker" / "config.json"
    secret.parent.mkdir(parents=True)
    secret.write_text('{"auths": {"registry": {"auth": "c2VjcmV0LXRva2Vu"}}}\n')
    real = inplace._check_unchanged

    def swapping(ckpt: object) -> None:
        real(ckpt)  # type: ignore[arg-type]
        index.unlink()
        index.symlink_to(secret)

    monkeypatch.setattr(inplace, "_check_unchanged", swapping)
    with pytest.raises(CheckpointError, match=r"link-escape"):
        weightmap.remap(root, mapping=RENAME, inplace=True)
    for path in root.iterdir():
        if path.is_file() and not path.is_symlink():
            assert b"c2VjcmV0LXRva2Vu" not in path.read_bytes(), path


def test_an_inplace_rename_never_writes_a_header_through_a_swapped_shard(
    tmp_path: Path, example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The shards' headers were written by opening their names (following links): a shard
    # swapped for a link to another file after the checks had that file written into.
    root = tmp_path / "sharded"
    weightmap.remap(example, root, mapping=KEEP_ALL, max_shard_size="64KB", progress=False)
    victim = tmp_path / "home" / ".bashrc"
    victim.parent.mkdir(parents=True)
    before = b"#" * 4096
    victim.write_bytes(before)
    shard = sorted(root.glob("model-*.safetensors"))[0]
    real = inplace._check_writable

    def swapping(*args: object) -> None:
        real(*args)  # type: ignore[arg-type]
        shard.unlink()
        shard.symlink_to(victim)

    monkeypatch.setattr(inplace, "_check_writable", swapping)
    with pytest.raises(ExecutionError, match=r"cannot rewrite its header: it is a link out of"):
        weightmap.remap(root, mapping=RENAME, inplace=True)
    assert victim.read_bytes() == before
    assert (root / ".weightmap-inplace-journal.json").exists()  # for `clean`, once it is back


def test_an_inplace_rename_still_follows_a_link_inside_the_folder(
    tmp_path: Path, example: Path
) -> None:
    root = tmp_path / "linked"
    weightmap.remap(example, root, mapping=KEEP_ALL, progress=False)
    (root / "model.safetensors").rename(root / "weights-v2.safetensors")
    (root / "model.safetensors").symlink_to("weights-v2.safetensors")
    weightmap.remap(root, mapping=RENAME, inplace=True)
    assert (root / "model.safetensors").is_symlink()
    names = {o.name for o in weightmap.compile(root, mapping=KEEP_ALL).outputs}
    assert "midlayer.self_attn.q_proj.weight" in names


# -- shards: a FIFO swapped in is refused, never waited on ---------------------------------------


def test_a_shard_swapped_for_a_fifo_is_refused_without_waiting(tmp_path: Path) -> None:
    # The folder's listing names special files, but the header was then read by opening the
    # name, which waits for a writer forever on a FIFO put there in between.
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def reading() -> None:
        try:
            read_header(fifo)
            outcome.append(None)
        except BaseException as err:
            outcome.append(err)

    thread = threading.Thread(target=reading, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():  # let the blocked open return before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail("read_header waited on a FIFO")
    assert isinstance(outcome[0], FormatError)
    assert "is a FIFO, not a safetensors file [not-a-file]" in str(outcome[0])


# -- `clean` writes into the folder it checked ------------------------------------------------


def _planted_journal(root: Path) -> None:
    """A journal in ``root`` (a one-shard checkpoint) whose header renames its first tensor
    to ``renamed``, as a downloaded folder may carry one."""
    import base64
    import json
    import struct

    raw = (root / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    first = next(k for k in header if k != "__metadata__")
    header["renamed"] = header.pop(first)
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (size - len(new))
    journal = {
        "files": {"model.safetensors": base64.b64encode(new).decode()},
        "index": None,
        "config": json.dumps({"model_type": "planted"}),
    }
    (root / inplace.JOURNAL_NAME).write_text(json.dumps(journal))


def test_clean_writes_into_the_folder_it_checked_though_its_name_is_swapped(
    tmp_path: Path, example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another user of a shared folder swaps the planted folder for a link to the victim's
    # checkpoint once the journal is checked: the writes went by name, through the link.
    shared, victim = tmp_path / "shared" / "x", tmp_path / "home" / "llama"
    shutil.copytree(example, shared)
    shutil.copytree(example, victim)
    _planted_journal(shared)
    before = {p.name: p.read_bytes() for p in victim.iterdir()}
    real = inplace._check_writable

    def swapping(root: Path, *args: object) -> None:
        real(root, *args)  # type: ignore[arg-type]
        shared.rename(shared.with_name("x-moved"))
        shared.symlink_to(victim)

    monkeypatch.setattr(inplace, "_check_writable", swapping)
    assert inplace.recover(shared)
    assert {p.name: p.read_bytes() for p in victim.iterdir()} == before
    moved = shared.with_name("x-moved")
    assert "renamed" in read_header(moved / "model.safetensors").tensors
    assert '"planted"' in (moved / "config.json").read_text()
    assert not (moved / inplace.JOURNAL_NAME).exists()


def test_clean_never_rewrites_a_shard_with_a_second_name(tmp_path: Path, example: Path) -> None:
    # A backup made with `cp -al` shares the shard's file: `convert --inplace` refuses such a
    # shard (inplace-link), and a planted journal must not get it rewritten either.
    root, backup = tmp_path / "x", tmp_path / "backup"
    shutil.copytree(example, root)
    backup.mkdir()
    os.link(root / "model.safetensors", backup / "model.safetensors")
    _planted_journal(root)
    before = (backup / "model.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match=r"has another name \(a hard link\)"):
        inplace.recover(root)
    assert (backup / "model.safetensors").read_bytes() == before
