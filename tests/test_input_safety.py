"""Every file of an input is opened once and read through that descriptor (issue 33).

A racer who can write to the input folder swaps a checked file for a link between the check
and the open: simulated here by swapping it right after weightmap resolved its name (the
moment its check is made). What the link points to must never be read. A FIFO or a device
where a small file should be is refused at once, never waited on or read without end. Side
files: a link to the folder itself is skipped, a file that changes while it is copied is
refused, holes stay holes, and the space they need is reserved before any tensor is written.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import weightmap
from races import swap_after_check
from weightmap.errors import CheckpointError, ExecutionError
from weightmap.inputs.checkpoint import Checkpoint
from weightmap.inputs.sidefiles import list_side_files

SECRET = '{"auths": {"registry": {"auth": "c2VjcmV0LXRva2Vu"}}}'
KEEP_ALL = "weightmap 1\nunmatched keep\n"


@pytest.fixture
def ckpt(tmp_path: Path, example: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(example, root)
    return root


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "home" / ".docker" / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(SECRET)
    return path


def test_config_swapped_for_a_link_after_its_check_is_never_read(
    ckpt: Path, secret: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    swapped = swap_after_check(monkeypatch, ckpt / "config.json", secret)
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(ckpt)
    assert swapped and info.value.rule == "changed"
    assert "c2VjcmV0" not in str(info.value)


def test_a_swapped_config_never_reaches_the_output(
    ckpt: Path, secret: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    swap_after_check(monkeypatch, ckpt / "config.json", secret)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"changed while it was opened.*\[changed\]"):
        weightmap.remap(ckpt, out, mapping=KEEP_ALL, progress=False)
    assert not out.exists()


def test_config_from_swapped_for_a_link_is_never_read(
    ckpt: Path, secret: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (ckpt / "params.json").write_text('{"dim": 8}')
    swap_after_check(monkeypatch, ckpt / "params.json", secret)
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(ckpt, config_name="params.json")
    assert info.value.rule == "changed"


def test_an_index_swapped_for_a_link_is_never_read(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00001.safetensors")
    with Checkpoint.open(ckpt / "model-00001-of-00001.safetensors") as c:
        names = list(c)
    index = {"weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"weight_map": {}, "leak": "c2VjcmV0"}))
    swap_after_check(monkeypatch, ckpt / "model.safetensors.index.json", elsewhere)
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(ckpt)
    assert info.value.rule == "changed"


def _one_line_refusal(args: list[str], env: dict[str, str] | None = None) -> str:
    """Run the CLI; it must refuse with one line, quickly (a hang fails on the timeout)."""
    result = subprocess.run(
        [sys.executable, "-m", "weightmap", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr


# The weights file too: its first bytes are read to tell a safetensors file from a torch zip
# or a GGUF file, and that read must not wait on a FIFO either.
@pytest.mark.parametrize(
    "name", ["config.json", "model.safetensors.index.json", "model.safetensors"]
)
@pytest.mark.parametrize("special", ["fifo", "/dev/zero"])
def test_a_fifo_or_device_as_a_small_file_is_refused_at_once(
    ckpt: Path, name: str, special: str
) -> None:
    path = ckpt / name
    path.unlink(missing_ok=True)
    if special == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(special)
    err = _one_line_refusal(["inspect", str(ckpt)])
    assert name in err


def test_a_link_to_the_folder_itself_is_skipped_not_a_crash(ckpt: Path, tmp_path: Path) -> None:
    (ckpt / "latest").symlink_to(".")
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / "up").symlink_to("..")
    (ckpt / "sub" / "notes.txt").write_text("kept")
    files = list_side_files(ckpt)
    assert [f.name for f in files.files] == ["sub/notes.txt"]
    assert any("'latest'" in s and "link to a folder" in s for s in files.skipped)
    assert any("'sub/up'" in s and "link to a folder" in s for s in files.skipped)
    for command in (["plan", str(ckpt), "--preset", "eagle3-sglang"],):
        result = subprocess.run(
            [sys.executable, "-m", "weightmap", *command], capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
        assert "IndexError" not in result.stderr
    out = tmp_path / "out"
    weightmap.remap(ckpt, out, mapping=KEEP_ALL, progress=False)
    assert (out / "sub" / "notes.txt").read_text() == "kept"
    assert not (out / "latest").exists()


# -- side files: what is committed is what was checked ------------------------------------------


def _while_copying(monkeypatch: pytest.MonkeyPatch, source: Path, action: object) -> None:
    """Run ``action`` once, inside the first kernel copy of bytes from ``source``."""
    real = os.copy_file_range
    done: list[bool] = []

    def copying(src: int, dst: int, count: int, *args: int) -> int:
        if not done and os.readlink(f"/proc/self/fd/{src}") == str(source):
            done.append(True)
            action()  # type: ignore[operator]
        return real(src, dst, count, *args)

    monkeypatch.setattr(os, "copy_file_range", copying)


@pytest.mark.parametrize("how", ["append", "rewrite"])
def test_a_side_file_changed_during_its_copy_is_refused(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    side = ckpt / "tokenizer.model"
    side.write_bytes(b"a" * 100_000)

    def change() -> None:
        if how == "append":
            with side.open("ab") as f:
                f.write(b"appended")
        else:
            with side.open("r+b") as f:  # same size, other bytes
                f.write(b"b" * 100_000)
            os.utime(side, ns=(1, 1))  # (as a second write a clock tick later would leave it)

    out = tmp_path / "out"
    _while_copying(monkeypatch, side, change)
    with pytest.raises(CheckpointError, match=r"changed while it was copied.*\[changed\]"):
        weightmap.remap(ckpt, out, mapping=KEEP_ALL, progress=False)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def _sparse(path: Path, size: int) -> None:
    with path.open("wb") as f:
        f.write(b"head")
        f.seek(size - 4)
        f.write(b"tail")


def _fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    if request.param == "tmp":
        yield tmp_path
        return
    from conftest import cow_mount

    yield from cow_mount("xfs", request.getfixturevalue("tmp_path_factory"))


@pytest.fixture(params=["tmp", "xfs"])
def folder(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A folder on this machine's file system, and on a loop-mounted XFS where one can be."""
    yield from _fs(request, tmp_path)


def test_a_sparse_side_file_stays_sparse(folder: Path, example: Path) -> None:
    src = folder / "src"
    shutil.copytree(example, src)
    size = 256 * 2**20
    _sparse(src / "tokenizer.model", size)
    out = folder / "out"
    weightmap.remap(src, out, mapping=KEEP_ALL, progress=False)
    copied = out / "tokenizer.model"
    assert copied.stat().st_size == size
    data = copied.read_bytes()
    assert data[:4] == b"head" and data[-4:] == b"tail" and data.count(0) == size - 8
    # A few blocks of data, not 256 MiB of zeros.
    assert copied.stat().st_blocks * 512 < 4 * 2**20


def test_the_side_files_space_is_reserved_before_any_tensor(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from weightmap.format import writer as writer_mod

    (ckpt / "tokenizer.model").write_bytes(b"t" * 300_000)
    _sparse(ckpt / "holes.bin.txt", 64 * 2**20)
    asked: list[int] = []
    real = writer_mod.fallocate

    def full_after_shards(fd: int, offset: int, length: int) -> bool:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".side-files.reserve"):
            asked.append(length)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, offset, length)

    monkeypatch.setattr(writer_mod, "fallocate", full_after_shards)
    out = tmp_path / "out"
    # Refused when the output is created, before any tensor byte is copied.
    with pytest.raises(ExecutionError, match=r"cannot create the output.*No space left"):
        weightmap.remap(ckpt, out, mapping=KEEP_ALL, progress=False)
    assert not out.exists()
    # The tokenizer's bytes and the sparse file's allocated blocks, not its 64 MiB.
    assert asked and 300_000 <= asked[0] < 300_000 + 2**20


# ---------------------------------------------------------------- weight files, opened once

# Opens (of any kind, by any name) of each weight file read-only, counted by an audit hook in
# a child process: os.open and open() raise the "open" event, a name relative to a folder's
# descriptor included; a map or a read through a descriptor raises none.
_COUNT_OPENS = """
import collections, json, os, sys
import weightmap

names = set(json.loads(sys.argv[2]))
seen = collections.Counter()

def hook(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else os.O_RDONLY
        name = os.path.basename(os.fsdecode(args[0]))
        if name in names and flags & os.O_ACCMODE == os.O_RDONLY:
            seen[name] += 1

sys.addaudithook(hook)
src, out, mode = sys.argv[1], sys.argv[3], sys.argv[4]
mapping = 'weightmap 1\\ncast "a.{n}" to bf16\\nrename "b.{n}" -> "c.{n}"\\n'
if mode == "remap":
    weightmap.remap(src, out, mapping=mapping, verify=True, progress=False)
else:
    for _name, _tensor in weightmap.iter_tensors(src, mapping=mapping):
        pass
print(json.dumps(seen))
"""


def _two_shards(root: Path, pickled: bool) -> list[str]:
    """A checkpoint of two shards under names of its own (the output's are the standard
    ones, so they are not counted), with an index; the shards' names."""
    import torch
    from safetensors.torch import save_file

    root.mkdir()
    ext = "bin" if pickled else "safetensors"
    names = [f"part-a.{ext}", f"part-b.{ext}"]
    weight_map = {}
    for i, name in enumerate(names):
        tensors = {f"a.{i}": torch.arange(64.0).reshape(8, 8), f"b.{i}": torch.ones(4, 4)}
        if pickled:
            torch.save(tensors, root / name)
        else:
            save_file(tensors, root / name)
        weight_map.update(dict.fromkeys(tensors, name))
    index = "pytorch_model.bin.index.json" if pickled else "model.safetensors.index.json"
    (root / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return names


@pytest.mark.parametrize("pickled", [False, True], ids=["safetensors", "pytorch"])
@pytest.mark.parametrize("mode", ["remap", "iter_tensors"])
def test_each_weight_file_is_opened_once(tmp_path: Path, pickled: bool, mode: str) -> None:
    """Its kind, its header, its map, the copies of its bytes and the verification's reads all
    go through one descriptor: a name is never looked up again once checked."""
    names = _two_shards(tmp_path / "src", pickled)
    r = subprocess.run(
        [sys.executable, "-c", _COUNT_OPENS, str(tmp_path / "src"), json.dumps(names),
         str(tmp_path / "out"), mode],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == dict.fromkeys(names, 1)


def test_a_weight_file_swapped_after_it_was_opened_is_not_read(tmp_path: Path) -> None:
    """Another file of the same size and modification time put under a shard's name once the
    checkpoint is open (a swap no size or time check can see) does not reach the output: the
    conversion reads the file it checked."""
    import torch
    from safetensors.torch import load_file, save_file

    names = _two_shards(tmp_path / "src", pickled=False)
    shard = tmp_path / "src" / names[0]
    impostor = tmp_path / "impostor.safetensors"
    save_file({"a.0": torch.full((8, 8), 7.0), "b.0": torch.full((4, 4), 7.0)}, impostor)
    assert impostor.stat().st_size == shard.stat().st_size
    with Checkpoint.open(tmp_path / "src") as ckpt:
        plan = weightmap.compile(ckpt, mapping=KEEP_ALL)
        st = shard.stat()
        os.utime(impostor, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(impostor, shard)
        from weightmap.execute.streaming import execute

        execute(plan, ckpt, tmp_path / "out")
    out: dict[str, torch.Tensor] = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        out.update(load_file(f))
    assert torch.equal(out["a.0"], torch.arange(64.0).reshape(8, 8))
    assert torch.equal(out["b.0"], torch.ones(4, 4))


def _open_fds() -> set[str]:
    return {os.readlink(f"/proc/self/fd/{n}") for n in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{n}")}  # fmt: skip


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_a_closed_checkpoint_is_never_read_again_by_name(tmp_path: Path) -> None:
    """Once closed, every read of a checkpoint's files says so (``closed``): a view, a
    pickle's tensors, a conversion, the verification of an output against it, a diff. The
    name opened again would read whatever it leads to by then."""
    import torch

    from weightmap.execute.streaming import execute
    from weightmap.inputs.diff import diff_checkpoints

    for pickled in (False, True):
        root = tmp_path / ("pt" if pickled else "st")
        _two_shards(root, pickled)
        ckpt = Checkpoint.open(root)
        plan = weightmap.compile(ckpt, mapping=KEEP_ALL)
        ckpt.close()
        with pytest.raises(CheckpointError, match="closed") as caught:
            ckpt.view("a.0")
        assert caught.value.rule == "closed"
        with pytest.raises(CheckpointError, match="closed"):
            execute(plan, ckpt, tmp_path / f"out-{root.name}")
        assert not (tmp_path / f"out-{root.name}").exists()
    weightmap.remap(tmp_path / "st", tmp_path / "done", mapping=KEEP_ALL, progress=False)
    closed = Checkpoint.open(tmp_path / "st")
    plan = weightmap.compile(closed, mapping=KEEP_ALL)
    closed.close()
    with pytest.raises(CheckpointError, match="closed"):
        weightmap.verify(tmp_path / "done", plan, source=closed)
    with Checkpoint.open(tmp_path / "done") as done, pytest.raises(CheckpointError):
        diff_checkpoints(closed, done)
    assert torch.equal(weightmap.Checkpoint.open(tmp_path / "st").view("b.0"), torch.ones(4, 4))


def test_a_joined_checkpoint_reads_no_descriptor_of_a_closed_part(tmp_path: Path) -> None:
    """A join (several inputs) reads through its parts' descriptors, looked up in the parts at
    each read: a part closed first makes the read say so, never read what a reused descriptor
    number names by then."""
    from weightmap.inputs.join import join

    _two_shards(tmp_path / "main", pickled=False)
    _two_shards(tmp_path / "part", pickled=False)
    main, part = Checkpoint.open(tmp_path / "main"), Checkpoint.open(tmp_path / "part")
    joined = join(main, [("adapter:", part)], ("adapter",))
    assert joined.view("adapter:b.0").sum() == 16
    part.close()
    with pytest.raises(CheckpointError, match="closed"):
        joined.view("adapter:a.1")  # (in the part's other file, not mapped yet)
    assert not set(joined.descriptors.values()) - set(main.descriptors.values())
    joined.close()
    assert main.descriptors  # (the join closes none of its parts' files)
    main.close()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_a_checkpoint_refused_after_its_files_were_opened_keeps_none_open(tmp_path: Path) -> None:
    """An index that disagrees with the shards is found once they are open: the refusal closes
    them, rather than keeping them open for as long as the error is held."""
    names = _two_shards(tmp_path / "src", pickled=False)
    index = tmp_path / "src" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["a.0"] = names[1]
    index.write_text(json.dumps(doc))
    before = _open_fds()
    with pytest.raises(CheckpointError) as caught:
        Checkpoint.open(tmp_path / "src")
    assert caught.value.rule == "index-mismatch"
    assert not {f for f in _open_fds() - before if f.endswith(tuple(names))}
