"""Hostile paths: loops of symbolic links, planted temporaries, a journal that is a link,
destinations through `..`, shards that are no files, and permissions widened on the way.

Each test failed before its fix (a traceback, a wrong message, a stray folder, a mode
widened); docs/safety.md says what is guaranteed instead."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import weightmap
from weightmap import CheckpointError, MappingError
from weightmap.errors import ExecutionError, OutputExistsError
from weightmap.format.layout import JOURNAL_NAME
from weightmap.format.writer import destination_path
from weightmap.fs.atomic import TMP_MARKER, stale_temporaries, temporaries
from weightmap.inputs.sidefiles import list_side_files

EXE = [sys.executable, "-m", "weightmap"]
KEEP = "weightmap 1\nunmatched keep\n"
RENAME = 'weightmap 1\nrename "layers.0.{rest*}" -> "midlayer.{rest}"\nunmatched keep\n'


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EXE, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def _no_traceback(r: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in r.stderr, r.stderr
    assert "RuntimeError" not in r.stderr and "OverflowError" not in r.stderr, r.stderr


@pytest.fixture
def ckpt(tmp_path: Path, example: Path) -> Path:
    root = tmp_path / "in"
    shutil.copytree(example, root)
    return root


def _index_of_one_shard(root: Path, example: Path, shard: str = "m.safetensors") -> None:
    """A folder whose index names ``shard`` (for every tensor); the shard itself is up to
    the test."""
    root.mkdir()
    shutil.copy(example / "config.json", root / "config.json")
    names = weightmap.Checkpoint.open(example).tensors
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, shard)}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


# -- 1. loops of symbolic links --------------------------------------------------------------------


def test_side_files_in_a_loop_of_links_are_skipped_with_a_warning(ckpt: Path) -> None:
    (ckpt / "b").symlink_to("a")
    (ckpt / "a").symlink_to("b")
    (ckpt / "self").symlink_to("self")
    listed = list_side_files(ckpt)
    assert listed.files == ()
    assert sorted(listed.skipped) == [
        f"side file {name!r} is not carried: it is a link in a loop of links"
        for name in ("a", "b", "self")
    ]
    r = _run("convert", str(ckpt), str(ckpt.parent / "out"), "--mapping", KEEP)
    _no_traceback(r)
    assert r.returncode == 0, r.stderr
    assert "'a' is not carried: it is a link in a loop of links" in r.stderr
    assert sorted(p.name for p in (ckpt.parent / "out").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]


def test_an_index_shard_in_a_loop_of_links_is_a_checkpoint_error(
    tmp_path: Path, example: Path
) -> None:
    root = tmp_path / "ix"
    _index_of_one_shard(root, example)
    (root / "m.safetensors").symlink_to("m.safetensors")
    with pytest.raises(CheckpointError, match="loop of links") as err:
        weightmap.Checkpoint.open(root)
    assert err.value.rule == "dangling-link"
    r = _run("inspect", str(root))
    _no_traceback(r)
    assert r.returncode == 1 and "[dangling-link]" in r.stderr


def test_a_config_in_a_loop_of_links_is_named_as_such(ckpt: Path) -> None:
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").symlink_to("config.json")
    with pytest.raises(CheckpointError, match="leads back to itself") as err:
        weightmap.Checkpoint.open(ckpt)
    assert err.value.rule == "dangling-link"


def test_a_checkpoint_path_in_a_loop_of_links_is_not_called_missing(tmp_path: Path) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    with pytest.raises(CheckpointError, match="loop of links") as err:
        weightmap.Checkpoint.open(loop)
    assert err.value.rule == "dangling-link"


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_destination_in_a_loop_of_links(ckpt: Path, overwrite: bool) -> None:
    dest = ckpt.parent / "loopdst"
    dest.symlink_to("loopdst")
    r = _run(
        "convert", str(ckpt), str(dest), "--mapping", KEEP, *(["--overwrite"] if overwrite else [])
    )
    _no_traceback(r)
    if overwrite:  # as for a link to nothing: the link itself is replaced, never followed
        assert r.returncode == 0, r.stderr
        assert not dest.is_symlink() and (dest / "model.safetensors").is_file()
    else:
        assert r.returncode == 1
        assert "is a symbolic link (to loopdst, a loop of links); remove it" in r.stderr
        assert dest.is_symlink() and os.readlink(dest) == "loopdst"
    assert not [p for p in ckpt.parent.iterdir() if TMP_MARKER in p.name]


def test_a_destination_in_a_loop_inside_the_input_folder_is_left_out(ckpt: Path) -> None:
    """The output folder named inside the input is no side file, even as a looping link."""
    dest = ckpt / "loop"
    dest.symlink_to("loop")
    listed = list_side_files(ckpt, exclude=[dest])
    assert listed.files == () and listed.skipped == ()


def test_an_include_in_a_loop_of_links_is_a_mapping_error(tmp_path: Path) -> None:
    (tmp_path / "loop.wm").symlink_to("loop.wm")
    main = tmp_path / "main.wm"
    main.write_text('weightmap 1\ninclude "loop.wm"\nunmatched keep\n')
    with pytest.raises(
        MappingError, match=re.escape("cannot include 'loop.wm': it is a symbolic link in")
    ):
        weightmap.load_mapping(main)
    with pytest.raises(MappingError, match="loop of links"):
        weightmap.load_mapping(tmp_path / "loop.wm")


# -- 2. temporaries whose names carry no pid -------------------------------------------------------


def _here() -> str:
    return f"{socket.gethostname()}+{os.stat('/proc/self/ns/pid').st_ino}"


@pytest.mark.parametrize(
    "owner",
    [
        "99999999999999999999",  # past a C long: os.kill raised OverflowError
        "4294967296@{here}",  # past pid_t, in the current format
        "²",  # str.isdigit() is true, int() refuses it
        "0",  # os.kill(0, 0) signals our own process group
    ],
)
def test_a_temporary_whose_pid_no_process_has_is_left_alone(
    tmp_path: Path, ckpt: Path, owner: str
) -> None:
    from weightmap.fs.atomic import host_name

    here = f"{host_name()}+{os.stat('/proc/self/ns/pid').st_ino}"
    planted = tmp_path / f".out{TMP_MARKER}{owner.format(here=here)}-ab"
    planted.mkdir()
    (planted / "keep.txt").write_text("not weightmap's")
    [(path, why)] = temporaries(tmp_path)
    assert path == planted and why is not None and "no process id" in why
    assert stale_temporaries(tmp_path, "out") == []
    r = _run("clean", str(tmp_path))
    _no_traceback(r)
    assert r.returncode == 0, r.stderr
    assert f"left {planted}: its name carries" in r.stdout
    # A conversion into that folder is not blocked by it, and leaves it as it was.
    r = _run("convert", str(ckpt), str(tmp_path / "out"), "--mapping", KEEP)
    _no_traceback(r)
    assert r.returncode == 0, r.stderr
    assert (planted / "keep.txt").read_text() == "not weightmap's"


def test_old_leftovers_and_dead_pids_are_still_stale(tmp_path: Path) -> None:
    old = tmp_path / f".out{TMP_MARKER}old-abcd"
    dead = tmp_path / f".out{TMP_MARKER}999999999-abcd"
    old.mkdir()
    dead.mkdir()
    assert stale_temporaries(tmp_path) == sorted([old, dead])


# -- 3. a journal that is a link to nothing --------------------------------------------------------


@pytest.mark.parametrize("target", ["nowhere", JOURNAL_NAME])
def test_recover_refuses_a_journal_that_is_a_broken_link(ckpt: Path, target: str) -> None:
    (ckpt / JOURNAL_NAME).symlink_to(target)
    with pytest.raises(CheckpointError, match="interrupted") as err:
        weightmap.Checkpoint.open(ckpt)
    assert err.value.rule == "interrupted-inplace"
    with pytest.raises(CheckpointError, match=f"it is a symbolic link to {target}") as err:
        weightmap.recover(ckpt)
    assert err.value.rule == "journal"
    assert f"delete {JOURNAL_NAME}" in str(err.value)
    assert (ckpt / JOURNAL_NAME).is_symlink()  # refused, not removed


@pytest.mark.parametrize("target", ["nowhere", JOURNAL_NAME])
def test_clean_refuses_a_journal_that_is_a_broken_link(ckpt: Path, target: str) -> None:
    """`inspect` says to run `clean`; `clean` must not then say there is nothing to clean."""
    (ckpt / JOURNAL_NAME).symlink_to(target)
    r = _run("clean", str(ckpt))
    _no_traceback(r)
    assert r.returncode != 0 and "nothing to clean" not in r.stdout
    assert "[journal]" in r.stderr and f"delete {JOURNAL_NAME}" in r.stderr


# -- 4. destinations through `..` ------------------------------------------------------------------


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_destination_ending_in_dotdot_is_refused_before_anything_is_made(
    ckpt: Path, overwrite: bool
) -> None:
    e = ckpt.parent / "e"
    e.mkdir()
    flag = ["--overwrite"] if overwrite else []
    r = _run("convert", str(ckpt), "e/x/..", "--mapping", KEEP, *flag, cwd=ckpt.parent)
    _no_traceback(r)
    assert r.returncode == 1
    assert "a destination ending in `..` or `.` names an existing folder" in r.stderr
    assert "Device or resource busy" not in r.stderr and "appeared" not in r.stderr
    assert list(e.iterdir()) == []
    with pytest.raises(ExecutionError, match="Give the output folder by its name"):
        destination_path(Path("e/x/.."))
    with pytest.raises(ExecutionError, match=re.escape("ending in `..` or `.`")):
        destination_path(Path("."))


def test_a_destination_that_holds_the_input_through_dotdot_says_so(ckpt: Path) -> None:
    r = _run("convert", "in", "in/..", "--overwrite", "--mapping", KEEP, cwd=ckpt.parent)
    _no_traceback(r)
    assert r.returncode == 1
    assert "inside the input folder" not in r.stderr  # false: it holds the input
    assert "ending in `..` or `.`" in r.stderr


def test_dotdot_through_folders_yet_to_be_made_leaves_none_behind(ckpt: Path) -> None:
    e = ckpt.parent / "e"
    e.mkdir()
    r = _run("convert", "in", "e/y/../z", "--mapping", KEEP, cwd=ckpt.parent)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in e.iterdir()) == ["z"]
    assert (e / "z" / "model.safetensors").is_file()
    # Only the part still to be made is taken lexically; the rest is the kernel's.
    assert destination_path(Path("a/b/../c")) == Path("a/c")
    assert destination_path(e / "y" / ".." / ".." / "w") == ckpt.parent / "e" / ".." / "w"
    (e / "real").mkdir()
    assert destination_path(e / "real" / ".." / "v") == e / "real" / ".." / "v"


# -- 5. index shards that are no files -------------------------------------------------------------


@pytest.mark.parametrize(("kind", "word"), [("fifo", "special file"), ("folder", "folder")])
def test_an_index_shard_that_is_no_file_is_named_as_such(
    tmp_path: Path, example: Path, kind: str, word: str
) -> None:
    root = tmp_path / "ix"
    _index_of_one_shard(root, example)
    if kind == "fifo":
        os.mkfifo(root / "m.safetensors")
    else:
        (root / "m.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=f"shard 'm.safetensors' is a {word}") as err:
        weightmap.Checkpoint.open(root)
    assert err.value.rule == "not-a-file"


def test_an_absent_index_shard_is_still_missing(tmp_path: Path, example: Path) -> None:
    root = tmp_path / "ix"
    _index_of_one_shard(root, example)
    with pytest.raises(CheckpointError, match=re.escape("do not exist: m.safetensors")) as err:
        weightmap.Checkpoint.open(root)
    assert err.value.rule == "missing-shard"


# -- 6. permissions --------------------------------------------------------------------------------


def test_carried_side_files_keep_their_permission_bits_but_no_exec_bit(ckpt: Path) -> None:
    secret, script = ckpt / "secret.txt", ckpt / "run.sh"
    secret.write_text("s")
    secret.chmod(0o600)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    out = ckpt.parent / "out"
    weightmap.remap(ckpt, out, mapping=KEEP, progress=False)
    assert stat.S_IMODE((out / "secret.txt").stat().st_mode) == 0o600
    # Nothing in an output folder is executable (docs/safety.md, "What a mapping may write").
    assert stat.S_IMODE((out / "run.sh").stat().st_mode) == 0o644


def test_an_inplace_rename_keeps_the_modes_of_the_files_it_replaces(
    tmp_path: Path, example: Path
) -> None:
    root = tmp_path / "sharded"
    weightmap.remap(example, root, mapping=KEEP, max_shard_size="64KB", progress=False)
    index, config = root / "model.safetensors.index.json", root / "config.json"
    assert index.is_file()
    index.chmod(0o600)
    config.chmod(0o640)
    rules = RENAME + 'config { torch_dtype = "bfloat16" }\n'
    weightmap.remap(root, mapping=rules, inplace=True)
    assert json.loads(config.read_text())["torch_dtype"] == "bfloat16"  # replaced, not kept
    assert "midlayer.self_attn.q_proj.weight" in json.loads(index.read_text())["weight_map"]
    assert stat.S_IMODE(index.stat().st_mode) == 0o600
    assert stat.S_IMODE(config.stat().st_mode) == 0o640
    assert not [p for p in root.iterdir() if TMP_MARKER in p.name]


def test_loops_are_refused_cleanly_when_a_destination_is_checked(ckpt: Path) -> None:
    """The writer alone: a looping link as the destination is refused, naming the loop."""
    dest = ckpt.parent / "loop"
    dest.symlink_to("loop")
    with pytest.raises(OutputExistsError, match="a loop of links"):
        weightmap.remap(ckpt, dest, mapping=KEEP, progress=False)


def test_a_destination_name_too_long_for_its_temporary_is_refused_up_front(
    ckpt: Path, tmp_path: Path
) -> None:
    # 250 bytes is a legal name, but not with the temporary's ~45 bytes added beside it.
    dest = tmp_path / ("o" * 250)
    with pytest.raises(ExecutionError, match=r"give a name of at most \d+ bytes"):
        weightmap.remap(ckpt, dest, mapping=KEEP)
    assert not dest.exists() and not any(tmp_path.glob(".o*"))
    short = tmp_path / ("o" * 150)
    weightmap.remap(ckpt, short, mapping=KEEP)
    assert (short / "model.safetensors").is_file()


# -- weight files found by name that link out of their folder ----------------------------------


def _secret(tmp_path: Path) -> Path:
    """A private checkpoint outside the downloaded folder: what a link must not reach."""
    from safetensors.torch import save_file as save_torch

    private = tmp_path / "home" / "private"
    private.mkdir(parents=True)
    save_torch({"secret.weight": torch.arange(8, dtype=torch.float32)}, private / "m.safetensors")
    torch.save({"secret.weight": torch.arange(4, dtype=torch.float32)}, private / "m.pth")
    return private


@pytest.mark.parametrize(
    "name", ["model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "w.pth"]
)
def test_a_weight_file_found_by_name_that_links_out_is_refused(tmp_path: Path, name: str) -> None:
    # A downloaded folder whose one weight file is a link to another checkpoint (the user's
    # private one): converting it would publish that checkpoint under the folder's name.
    private = _secret(tmp_path)
    target = private / ("m.safetensors" if name.endswith(".safetensors") else "m.pth")
    folder = tmp_path / "downloaded"
    folder.mkdir()
    (folder / name).symlink_to(os.path.relpath(target, folder))
    with pytest.raises(CheckpointError) as info:
        weightmap.Checkpoint.open(folder)
    assert info.value.rule == "shard-escape"
    assert "leaves the checkpoint's folder" in str(info.value) and str(target) in str(info.value)
    out = tmp_path / "out"
    r = _run("convert", str(folder), str(out), "--mapping", KEEP)
    assert r.returncode == 1 and "[shard-escape]" in r.stderr, r.stderr
    assert not out.exists()


@pytest.mark.parametrize("target", ["real.safetensors", "w/real.safetensors"])
def test_a_weight_file_linked_within_its_folder_or_into_hub_blobs_is_read(
    tmp_path: Path, example: Path, target: str
) -> None:
    # (A file in a subfolder stays in the folder as well.)
    inside = tmp_path / "inside"
    (inside / "w").mkdir(parents=True)
    shutil.copy(example / "model.safetensors", inside / target)
    (inside / "model.safetensors").symlink_to(target)
    assert weightmap.Checkpoint.open(inside).tensors
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / ("a" * 40)
    blobs = tmp_path / "hub" / "models--org--name" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    shutil.copy(example / "model.safetensors", blobs / "0123abcd")
    (snapshot / "model.safetensors").symlink_to("../../blobs/0123abcd")
    assert weightmap.Checkpoint.open(snapshot).tensors
    assert weightmap.Checkpoint.open(snapshot / "model.safetensors").tensors


def test_an_inplace_rename_follows_an_absolute_link_to_a_file_of_its_folder(
    tmp_path: Path, example: Path
) -> None:
    # The replay refused any link whose target held a "/", after the journal was written:
    # the checkpoint was left locked behind it, with a message saying the folder changed.
    folder = tmp_path / "ck"
    folder.mkdir()
    shutil.copy(example / "model.safetensors", folder / "real.safetensors")
    shutil.copy(example / "config.json", folder / "config.json")
    (folder / "model.safetensors").symlink_to(folder / "real.safetensors")
    weightmap.remap(folder, mapping=RENAME, inplace=True)
    assert not (folder / JOURNAL_NAME).exists()
    assert "midlayer.self_attn.q_proj.weight" in weightmap.Checkpoint.open(folder).tensors


def test_a_file_given_as_a_link_out_of_its_folder_says_to_give_the_file(tmp_path: Path) -> None:
    private = _secret(tmp_path)
    (tmp_path / "given").mkdir()
    link = tmp_path / "given" / "link.safetensors"
    link.symlink_to(private / "m.safetensors")
    with pytest.raises(CheckpointError) as info:
        weightmap.Checkpoint.open(link)
    assert info.value.rule == "shard-escape" and "give the path it points to" in str(info.value)
    assert weightmap.Checkpoint.open(private / "m.safetensors").tensors


@pytest.mark.parametrize("member", ["part.1.safetensors", "part.1.pth", "part.1.d"])
def test_a_family_member_that_links_out_is_refused(
    tmp_path: Path, example: Path, member: str
) -> None:
    private = _secret(tmp_path)
    folder = tmp_path / "downloaded"
    folder.mkdir()
    shutil.copy(example / "model.safetensors", folder / "part.0.safetensors")
    target = {
        "part.1.safetensors": private / "m.safetensors",
        "part.1.pth": private / "m.pth",
        "part.1.d": private,  # a member folder, linked out
    }[member]
    (folder / member).symlink_to(os.path.relpath(target, folder))
    mapping = (
        'weightmap 1\ninput ranks files "part.{rank}.*"\n'
        'rename "ranks:{r:int}:{x*}" -> "{x}.r{r}"\n'
    )
    out = tmp_path / "out"
    r = _run("convert", str(folder), str(out), "--mapping", mapping)
    assert r.returncode == 1 and "[shard-escape]" in r.stderr and member in r.stderr, r.stderr
    assert not out.exists()


def test_overwrite_never_replaces_a_hub_snapshot_that_is_the_input(
    tmp_path: Path, example: Path
) -> None:
    # The snapshot's files are links into blobs/: where they lead is outside the destination,
    # but the folder their names are in is the destination itself.
    repo = tmp_path / "hub" / "models--org--name"
    snapshot, blobs = repo / "snapshots" / ("a" * 40), repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, name in enumerate(["model.safetensors", "config.json", "tokenizer.json"]):
        source = example / name if (example / name).exists() else None
        blob = blobs / f"b{i}"
        if source is None:
            blob.write_text("{}")
        else:
            shutil.copy(source, blob)
        (snapshot / name).symlink_to(f"../../blobs/b{i}")
    before = sorted((p.name, os.readlink(p)) for p in snapshot.iterdir())
    r = _run("convert", str(snapshot), str(snapshot), "--mapping", RENAME, "--overwrite")
    assert r.returncode == 1 and "the destination holds the input" in r.stderr, r.stderr
    assert sorted((p.name, os.readlink(p)) for p in snapshot.iterdir()) == before


def test_the_temporary_folder_moved_and_replaced_by_a_link_gets_nothing_through_it(
    tmp_path: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In a shared destination folder another user renames the temporary folder while it is
    # written and puts a link to a folder of yours under its name: the config, index and
    # side files were written by name, through the link, and the link was moved into place.
    import weightmap.execute.sidefiles as side

    victim = tmp_path / "home" / "private"
    victim.mkdir(parents=True)
    victim.chmod(0o700)
    real = side.write_side_files
    moved: list[Path] = []

    def swapping(files, root, folder, progress=None):  # type: ignore[no-untyped-def]
        tmp = next(p for p in tmp_path.iterdir() if "weightmap-tmp" in p.name)
        tmp.rename(tmp_path / "elsewhere")
        tmp.symlink_to(victim)
        moved.append(tmp)
        return real(files, root, folder, progress)

    monkeypatch.setattr(side, "write_side_files", swapping)
    out = tmp_path / "out"
    with pytest.raises(ExecutionError, match="was moved or replaced while the output was written"):
        weightmap.remap(ckpt, out, mapping=RENAME, progress=False)
    assert moved and list(victim.iterdir()) == [] and stat.S_IMODE(victim.stat().st_mode) == 0o700
    assert not out.exists() and not out.is_symlink()
    # What was written went into the folder itself, wherever it was moved.
    assert (tmp_path / "elsewhere" / "model.safetensors").exists()
