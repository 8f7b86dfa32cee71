"""Faults: kill -9 at random points, a full disk, I/O errors, racing conversions, inputs that
change under a running conversion. The destination is either absent or complete; the input
is never touched; leftovers are recognisable and cleaned."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import weightmap
import weightmap.format.writer as writer_mod
from weightmap import Checkpoint, CheckpointError, ExecutionError, FormatError
from weightmap.fs.atomic import TMP_MARKER

EXE = [sys.executable, "-m", "weightmap"]
CAST = 'weightmap 1\ncast "{x*}" to bf16 where dtype == f32\nunmatched keep\n'
RENAME = 'weightmap 1\nrename "layers.{n:int}.{r*}" -> "blocks.{n}.{r}"\nunmatched keep\n'


def _hash(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 48 MB in 24 tensors: a conversion takes long enough to be killed mid-way."""
    root = tmp_path_factory.mktemp("big") / "ckpt"
    root.mkdir()
    gen = torch.Generator().manual_seed(0)
    save_file(
        {f"layers.{i}.w": torch.randn(512, 1024, generator=gen) for i in range(24)},
        root / "model.safetensors",
    )
    return root


@pytest.fixture(scope="module")
def expected(big: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The complete outputs, made once without interference."""
    out = tmp_path_factory.mktemp("expected")
    results = {}
    for name, rules in (("cast", CAST), ("rename", RENAME)):
        weightmap.remap(big, out / name, mapping=rules, max_shard_size="20MB", progress=False)
        results[name] = out / name
    return results


def _same_output(a: Path, b: Path) -> bool:
    return _hash(a) == _hash(b)


def _temporary_lifetime(
    proc: subprocess.Popen[bytes], folder: Path, until_seen: bool = False
) -> float | None:
    """Seconds during which a temporary folder of the run ``proc`` is in ``folder`` (None if
    it never showed); ``until_seen``: return as soon as it shows (0.0)."""
    first = last = None
    while proc.poll() is None:
        if any(TMP_MARKER in p.name for p in folder.iterdir()):
            last = time.monotonic()
            first = first or last
            if until_seen:
                return 0.0
        time.sleep(0.002)
    return None if first is None or last is None else last - first


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["cast", "rename"])
def test_kill_9_at_random_points(
    big: Path, expected: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    rules = tmp_path / "rules.wm"
    rules.write_text(CAST if kind == "cast" else RENAME)
    before = _hash(big)
    dest = tmp_path / "out"
    cmd = [
        *EXE,
        "convert",
        str(big),
        str(dest),
        "--mapping",
        str(rules),
        "--max-shard-size",
        "20MB",
        "--no-progress",
        "--quiet",
    ]
    start = time.monotonic()
    proc = subprocess.Popen(cmd)
    # How long the temporary folder lives (the writing): imports and the plan come before it,
    # and they take most of the run, so kills timed by the whole run alone would seldom land
    # in the writing.
    window = _temporary_lifetime(proc, tmp_path)
    assert proc.wait(timeout=300) == 0
    full = time.monotonic() - start  # interpreter start, imports, then the conversion
    shutil.rmtree(dest)
    rng = random.Random(1234)
    outcomes = {"before": 0, "mid-write": 0, "complete": 0}
    for i in range(12):
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if i % 2 and _temporary_lifetime(proc, tmp_path, until_seen=True) is not None:
            # Every other kill lands in the writing: once the temporary folder is there.
            time.sleep(rng.uniform(0.0, 0.8) * (window or 0.0))
        else:  # anywhere in the run, the start and the commit included
            time.sleep(full * rng.choice([rng.uniform(0.1, 0.6), rng.uniform(0.6, 1.05)]))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        leftovers = [p for p in tmp_path.iterdir() if TMP_MARKER in p.name]
        assert all(p.name.startswith(f".out{TMP_MARKER}") for p in leftovers)
        if dest.exists():
            assert _same_output(dest, expected[kind]), "a partial destination"
            outcomes["complete"] += 1
            shutil.rmtree(dest)
        else:
            outcomes["mid-write" if leftovers else "before"] += 1
        assert _hash(big) == before, "the input changed"
    # The next run clears what the killed ones left and completes.
    r = subprocess.run(
        [
            *EXE,
            "convert",
            str(big),
            str(dest),
            "--mapping",
            str(rules),
            "--max-shard-size",
            "20MB",
            "--quiet",
        ],
        capture_output=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert _same_output(dest, expected[kind])
    assert not [p for p in tmp_path.iterdir() if TMP_MARKER in p.name]
    if kind == "cast":  # ~0.4 s of writing: some kills must land in it
        assert outcomes["mid-write"] > 0, outcomes


def _fail_after(real, budget: list[int], err: int):  # type: ignore[no-untyped-def]
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        if budget[0] <= 0:
            raise OSError(err, os.strerror(err))
        budget[0] -= 1
        return real(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("where", ["pwrite", "copy_file_range", "fallocate"])
def test_disk_full_and_io_errors(
    big: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, where: str
) -> None:
    before = _hash(big)
    budget = [3]
    if where == "fallocate":
        budget = [0]
        monkeypatch.setattr(
            writer_mod.os, "posix_fallocate", _fail_after(os.posix_fallocate, budget, err)
        )
    elif where == "pwrite":
        monkeypatch.setattr(writer_mod.os, "pwrite", _fail_after(os.pwrite, budget, err))
    else:
        monkeypatch.setattr(
            writer_mod.os, "copy_file_range", _fail_after(os.copy_file_range, budget, err)
        )
    rules = CAST if where == "pwrite" else RENAME
    with pytest.raises(ExecutionError) as info:
        weightmap.remap(big, tmp_path / "out", mapping=rules, progress=False, workers=2)
    assert str(tmp_path / "out") in str(info.value)
    assert os.strerror(err) in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert _hash(big) == before


@pytest.mark.slow
def test_two_conversions_into_one_destination(
    big: Path, expected: dict[str, Path], tmp_path: Path
) -> None:
    dest = tmp_path / "out"
    for rules_text in (CAST, RENAME):
        (tmp_path / f"{len(rules_text)}.wm").write_text(rules_text)
    procs = [
        subprocess.Popen(
            [
                *EXE,
                "convert",
                str(big),
                str(dest),
                "--mapping",
                str(tmp_path / f"{len(t)}.wm"),
                "--max-shard-size",
                "20MB",
                "--quiet",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for t in (CAST, RENAME)
    ]
    results = [(*p.communicate(timeout=300), p.returncode) for p in procs]
    assert sorted(r[2] for r in results) == [0, 1]  # exactly one wins
    assert _same_output(dest, expected["cast"]) or _same_output(dest, expected["rename"])
    for _, stderr, code in results:
        if code == 1:
            assert "already exists" in stderr or "appeared" in stderr
    assert not [p for p in tmp_path.iterdir() if TMP_MARKER in p.name]


def test_input_changed_during_conversion(tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    save_file({f"w{i}": torch.randn(64, 64) for i in range(4)}, src / "model.safetensors")
    touched = []

    def touch(done: int, total: int) -> None:
        if not touched:
            touched.append(True)
            st = (src / "model.safetensors").stat()
            os.utime(src / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    with pytest.raises(FormatError, match="changed while the conversion ran") as info:
        weightmap.remap(src, tmp_path / "out", mapping=CAST, progress=touch, workers=1)
    assert info.value.rule == "changed"
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["in"]


def test_input_replaced_between_open_and_run_is_read_as_opened(tmp_path: Path) -> None:
    """A file put in the input's place (a new file renamed over it, as save_file writes) does
    not reach the output: every read goes through the descriptor the checkpoint opened, so
    the conversion reads the file it checked and planned for, start to end."""
    src = tmp_path / "in"
    src.mkdir()
    save_file({"w": torch.zeros(8)}, src / "model.safetensors")
    with Checkpoint.open(src) as ckpt:
        plan = weightmap.compile(ckpt, mapping=CAST)
        save_file({"w": torch.ones(8)}, src / "model.safetensors")  # same shape, new bytes
        from weightmap.execute.streaming import execute

        execute(plan, ckpt, tmp_path / "out")
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(out["w"], torch.zeros(8, dtype=torch.bfloat16))


def test_input_rewritten_in_place_between_open_and_run(tmp_path: Path) -> None:
    """The same file written over (its inode, which the checkpoint reads through): refused,
    as its size or modification time no longer match what its header was read with."""
    src = tmp_path / "in"
    src.mkdir()
    shard = src / "model.safetensors"
    save_file({"w": torch.zeros(8)}, shard)
    with Checkpoint.open(src) as ckpt:
        plan = weightmap.compile(ckpt, mapping=CAST)
        with shard.open("r+b") as f:
            f.seek(-4, os.SEEK_END)
            f.write(b"\x00\x00\x80\x3f")  # the last value: 1.0
        st = shard.stat()
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        from weightmap.execute.streaming import execute

        with pytest.raises(FormatError, match="changed"):
            execute(plan, ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- in place ---------------------------------------------------------------------------------

INPLACE_DRIVER = textwrap.dedent(
    """
    import os, signal, sys
    import weightmap.execute.inplace as inplace

    limit = int(sys.argv[3])
    real = os.pwrite
    def torn(fd, data, offset):
        # Write part of the header, then die as kill -9 would: a torn multi-page write.
        real(fd, bytes(data)[:limit], offset)
        os.kill(os.getpid(), signal.SIGKILL)
    if limit >= 0:
        inplace.os.pwrite = torn
    import weightmap
    weightmap.remap(sys.argv[1], mapping=sys.argv[2], inplace=True)
    """
)


def _names(root: Path) -> set[str]:
    return set(load_file(root / "model.safetensors"))


@pytest.mark.slow
def test_kill_9_during_inplace_rewrite(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    # 2,000 tensors: a header of many pages, so a kill can tear it.
    save_file(
        {f"layers.{i}.w": torch.full((2,), float(i)) for i in range(2000)},
        root / "model.safetensors",
    )
    data_before = (root / "model.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(data_before[:8], "little")
    old = _names(root)
    new = {n.replace("layers.", "blocks.") for n in old}
    forward = 'weightmap 1\nrename "layers.{r*}" -> "blocks.{r}"\n'
    backward = 'weightmap 1\nrename "blocks.{r*}" -> "layers.{r}"\n'
    driver = tmp_path / "driver.py"
    driver.write_text(INPLACE_DRIVER)
    rng = random.Random(7)
    state = old
    for limit in [
        0,
        1,
        4096,
        50_000,
        header_end // 2,
        *[rng.randrange(header_end) for _ in range(5)],
    ]:
        rules = forward if state == old else backward
        target = new if state == old else old
        r = subprocess.run(
            [sys.executable, str(driver), str(root), rules, str(limit)],
            capture_output=True,
            timeout=120,
        )
        assert r.returncode == -signal.SIGKILL
        # Either untouched, or refused until recovered — never a mixed header read as valid.
        try:
            Checkpoint.open(root).close()
            assert _names(root) == state
        except CheckpointError as exc:
            assert exc.rule == "interrupted-inplace"
            assert weightmap.recover(root) is True
            state = target
        assert _names(root) == state
        assert (root / "model.safetensors").read_bytes()[header_end:] == data_before[header_end:]
    # And an uninterrupted run still works afterwards.
    rules = forward if state == old else backward
    r = subprocess.run(
        [sys.executable, str(driver), str(root), rules, "-1"], capture_output=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert _names(root) == (new if state == old else old)
