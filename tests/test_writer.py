"""The writer: byte identity with the reference, sharding, atomic and safe output."""

from __future__ import annotations

import ctypes.util
import errno
import json
import os
import random
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path
from types import MappingProxyType

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save, save_file

from strategies import TORCH_DTYPES, checkpoints
from weightmap.errors import ExecutionError, OutputExistsError
from weightmap.format import transfer as transfer_module
from weightmap.format import writer as writer_module
from weightmap.format.dtypes import TensorSpec
from weightmap.format.layout import parse_size, plan_shards
from weightmap.format.writer import CheckpointWriter, _index_parts, _index_text
from weightmap.fs.atomic import TMP_MARKER, _renameat2, owner_tag, stale_temporaries
from weightmap.inputs.checkpoint import Checkpoint


def _spec(name: str, t: torch.Tensor) -> TensorSpec:
    code = next(k for k, v in TORCH_DTYPES.items() if v == t.dtype)
    return TensorSpec(name, code, tuple(t.shape))


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def write_tensors(dest: Path, tensors: Mapping[str, torch.Tensor], **kw: object) -> Path:
    specs = [_spec(n, t) for n, t in tensors.items()]
    with CheckpointWriter(dest, specs, **kw) as w:  # type: ignore[arg-type]
        for name, t in tensors.items():
            w.write(name, _raw(t))
    return dest


def _all_dtype_tensors() -> dict[str, torch.Tensor]:
    out = {}
    for i, (code, dt) in enumerate(sorted(TORCH_DTYPES.items())):
        base = torch.arange(6, dtype=torch.float32).reshape(2, 3) + i
        out[f"t.{code.lower()}"] = base.to(dt)
    out["scalar"] = torch.tensor(3.5)
    out["empty"] = torch.zeros(0, 4, dtype=torch.float16)
    return out


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_byte_identical_to_reference(tmp_path: Path, metadata: dict[str, str] | None) -> None:
    tensors = _all_dtype_tensors()
    write_tensors(tmp_path / "out", tensors, metadata=metadata)
    save_file(tensors, tmp_path / "ref.safetensors", metadata=metadata)
    ours = (tmp_path / "out" / "model.safetensors").read_bytes()
    assert ours == (tmp_path / "ref.safetensors").read_bytes()


def test_example_rewritten_byte_identical(example: Path, tmp_path: Path) -> None:
    with Checkpoint.open(example) as ckpt:
        tensors = {n: ckpt.view(n).clone() for n in ckpt}
        meta = dict(ckpt.headers[ckpt.files[0]].metadata or {})
    write_tensors(tmp_path / "out", tensors, metadata=meta)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        example / "model.safetensors"
    ).read_bytes()


def test_the_writer_lets_the_headers_go_once_written(tmp_path: Path) -> None:
    """A header holds a hundred bytes per tensor: once open() has written it, only where the
    shard's data starts is kept, and the shards are still complete and right."""
    tensors = {f"t{i}": torch.full((8,), float(i)) for i in range(40)}
    specs = [_spec(n, t) for n, t in tensors.items()]
    writer = CheckpointWriter(tmp_path / "out", specs, max_shard_size=400)
    planned = [len(s.header) for s in writer.shards]
    assert len(planned) > 1 and writer.data_starts == planned
    with writer:
        assert all(s.header == b"" for s in writer.shards)
        for name, t in tensors.items():
            writer.write(name, _raw(t))
    for shard, start in zip(writer.shards, writer.data_starts, strict=True):
        raw = (tmp_path / "out" / shard.filename).read_bytes()
        assert 8 + int.from_bytes(raw[:8], "little") == start
    with Checkpoint.open(tmp_path / "out") as ckpt:
        assert all(torch.equal(ckpt.view(n), t) for n, t in tensors.items())


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(tensors=checkpoints())
def test_hypothesis_matches_reference(
    tmp_path_factory: pytest.TempPathFactory, tensors: dict[str, torch.Tensor]
) -> None:
    out = tmp_path_factory.mktemp("h") / "out"
    write_tensors(out, tensors, metadata={"format": "pt"})
    ours = (out / "model.safetensors").read_bytes()
    assert ours == save(tensors, metadata={"format": "pt"})
    back = load_file(out / "model.safetensors")
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape
        assert _raw(back[k]) == _raw(t)


_ODD = st.text(
    st.one_of(st.characters(), st.sampled_from(["\ud800", "\udfff", '"', "\\", "\n", "\x00"])),
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(
    weight_map=st.dictionaries(_ODD, _ODD, max_size=8),
    total=st.integers(0, 2**64),
)
def test_index_text_is_the_indented_json(weight_map: dict[str, str], total: int) -> None:
    """The index as ``json.dumps(index, indent=2, sort_keys=True)`` writes it, whatever the
    names hold (quotes, backslashes, control characters, non-ASCII, lone surrogates)."""
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    want = json.dumps(index, indent=2, sort_keys=True) + "\n"
    assert _index_text(total, weight_map) == want
    assert _index_text(total, MappingProxyType(weight_map)) == want


@settings(max_examples=100, deadline=None)
@given(weight_map=st.dictionaries(_ODD, _ODD, max_size=8), lines=st.integers(1, 4))
def test_index_parts_join_to_the_indented_json(weight_map: dict[str, str], lines: int) -> None:
    """The index made a few lines at a time (as the writer writes it) is the same text."""
    index = {"metadata": {"total_size": 7}, "weight_map": weight_map}
    want = json.dumps(index, indent=2, sort_keys=True) + "\n"
    assert "".join(_index_parts(7, weight_map, lines)) == want


def test_index_written_in_parts_is_the_indented_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An index of more names than one part holds is written whole, part after part."""
    monkeypatch.setattr(writer_module, "_INDEX_LINES", 3)
    specs = [TensorSpec(f"t.{i}", "U8", (100,)) for i in range(10)]
    with CheckpointWriter(tmp_path / "out", specs, max_shard_size=300) as w:
        for spec in specs:
            w.write(spec.name, bytes(100))
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == 10
    want = json.dumps(index, indent=2, sort_keys=True) + "\n"
    assert (tmp_path / "out" / "model.safetensors.index.json").read_text() == want


def test_sharded_round_trip(tmp_path: Path) -> None:
    tensors = {f"layer.{i}.w": torch.full((250,), float(i)) for i in range(10)}  # 1000 B each
    write_tensors(tmp_path / "out", tensors, max_shard_size="2500B")
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == [
        "model-00001-of-00005.safetensors",
        "model-00002-of-00005.safetensors",
        "model-00003-of-00005.safetensors",
        "model-00004-of-00005.safetensors",
        "model-00005-of-00005.safetensors",
        "model.safetensors.index.json",
    ]
    text = (tmp_path / "out" / "model.safetensors.index.json").read_text()
    index = json.loads(text)
    assert text == json.dumps(index, indent=2, sort_keys=True) + "\n"
    assert index["metadata"]["total_size"] == 10_000
    assert index["weight_map"]["layer.2.w"] == "model-00002-of-00005.safetensors"
    with Checkpoint.open(tmp_path / "out") as ckpt:
        assert sorted(ckpt) == sorted(tensors)
        for k, t in tensors.items():
            assert torch.equal(ckpt.view(k), t)


def test_plan_shards_big_tensor_alone() -> None:
    specs = [
        TensorSpec("a", "U8", (10,)),
        TensorSpec("big", "U8", (100,)),
        TensorSpec("b", "U8", (10,)),
        TensorSpec("c", "U8", (10,)),
    ]
    plans = plan_shards(specs, 25)
    assert [sorted(p.offsets) for p in plans] == [["a"], ["big"], ["b", "c"]]
    assert plan_shards(specs, "1GB")[0].filename == "model.safetensors"


def test_threads_write_chunks_in_any_order(tmp_path: Path) -> None:
    tensors = {f"w{i}": torch.randn(64, 33) for i in range(8)}
    specs = [_spec(n, t) for n, t in tensors.items()]
    jobs = []
    for name, t in tensors.items():
        raw = _raw(t)
        jobs += [(name, raw[o : o + 100], o) for o in range(0, len(raw), 100)]
    random.Random(0).shuffle(jobs)
    with CheckpointWriter(tmp_path / "out", specs) as w, ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda j: w.write(j[0], j[1], j[2]), jobs))
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == save(tensors)


def test_copy_range_from_file(tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 4)
    spec = TensorSpec("w", "U8", (512,))
    import os

    fd = os.open(src, os.O_RDONLY)
    try:
        with CheckpointWriter(tmp_path / "out", [spec]) as w:
            w.copy_range("w", fd, 256, 300)
            w.copy_range("w", fd, 0, 212, offset=300)
    finally:
        os.close(fd)
    data = load_file(tmp_path / "out" / "model.safetensors")["w"].numpy().tobytes()
    assert data == (bytes(range(256)) * 4)[256:556] + (bytes(range(256)) * 4)[:212]


def test_config_written(tmp_path: Path) -> None:
    write_tensors(tmp_path / "out", {"a": torch.zeros(1)}, config={"x": [1, 2], "é": None})
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {"x": [1, 2], "é": None}


def test_existing_destination_refused_then_overwritten(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "keep.txt").write_text("old")
    with pytest.raises(OutputExistsError, match="overwrite=True"):
        write_tensors(dest, {"a": torch.zeros(1)})
    assert (dest / "keep.txt").read_text() == "old"
    write_tensors(dest, {"a": torch.ones(1)}, overwrite=True)
    assert sorted(p.name for p in dest.iterdir()) == ["model.safetensors"]
    assert not list(tmp_path.glob(f"*{TMP_MARKER}*"))


def test_commits_look_renameat2_up_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C library's renameat2 is found once per process, not by running ldconfig (what
    ``ctypes.util.find_library`` does) on every commit; new folders and overwrites both work
    with it."""
    _renameat2.cache_clear()
    write_tensors(tmp_path / "first", {"a": torch.zeros(1)})
    looked_up = _renameat2()

    def no_subprocess(name: str) -> str | None:
        raise AssertionError(f"find_library({name!r}) ran during a commit")

    monkeypatch.setattr(ctypes.util, "find_library", no_subprocess)
    dest = tmp_path / "out"
    write_tensors(dest, {"a": torch.zeros(1)})
    write_tensors(dest, {"a": torch.ones(1)}, overwrite=True)  # the RENAME_EXCHANGE path
    assert load_file(dest / "model.safetensors")["a"].tolist() == [1.0]
    assert _renameat2() is looked_up
    assert not list(tmp_path.glob(f"*{TMP_MARKER}*"))


def test_overwrite_without_renameat2_restores_the_old_output_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where renameat2 is missing, an overwrite moves the old output aside and the new one in:
    if the second rename fails, the old output is put back under its name."""
    import weightmap.format.writer as writer_mod

    dest = tmp_path / "out"
    write_tensors(dest, {"a": torch.zeros(1)})
    monkeypatch.setattr(writer_mod, "renameat2", lambda src, dst, flags: False)
    real_rename = os.rename

    def failing(src: object, dst: object) -> None:
        if TMP_MARKER in str(src) and not str(src).endswith("-old"):  # the new output moving in
            # The old output, aside, is this live process's: no other run may take it for a
            # stale leftover and remove it while it may have to go back.
            aside = [p for p in tmp_path.iterdir() if p.name.endswith("-old")]
            assert len(aside) == 1 and owner_tag() in aside[0].name
            assert aside[0] not in stale_temporaries(tmp_path)
            raise OSError(errno.EIO, "injected failure")
        real_rename(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError, match="injected failure"):
        write_tensors(dest, {"a": torch.ones(1)}, overwrite=True)
    monkeypatch.setattr(os, "rename", real_rename)
    assert load_file(dest / "model.safetensors")["a"].tolist() == [0.0]
    assert not list(tmp_path.glob(f"*{TMP_MARKER}*"))
    write_tensors(dest, {"a": torch.ones(1)}, overwrite=True)  # the fallback itself works
    assert load_file(dest / "model.safetensors")["a"].tolist() == [1.0]


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_temporary_folder_is_private_until_committed(tmp_path: Path, umask: int) -> None:
    """While it is written, the temporary folder is the user's alone (tasks reopen its files
    by path); the committed folder has the mode a new folder gets there (the umask, or a
    default ACL of the parent)."""
    old = os.umask(umask)
    try:
        (tmp_path / "plain").mkdir()
        expected = (tmp_path / "plain").stat().st_mode & 0o777
        dest = tmp_path / "out"
        w = CheckpointWriter(dest, [TensorSpec("a", "U8", (1,))])
        w.open()
        assert w.tmp is not None and w.tmp.stat().st_mode & 0o777 == 0o700
        w.write("a", b"\1")
        w.commit()
        assert dest.stat().st_mode & 0o777 == expected == 0o777 & ~umask
    finally:
        os.umask(old)


def test_temporary_folder_names_its_host_and_pid_namespace(tmp_path: Path) -> None:
    """A local conversion's temporary folder carries where its pid can be checked, as a cluster
    run's does: on a volume shared between containers, one with its own pids must not take
    another's live conversion for a dead one."""
    w = CheckpointWriter(tmp_path / "out", [TensorSpec("a", "U8", (1,))])
    w.open()
    try:
        assert w.tmp is not None and w.tmp.name.startswith(f".out{TMP_MARKER}{owner_tag()}-")
        assert stale_temporaries(tmp_path) == []
    finally:
        w.abort()


def test_destination_holding_the_input_is_refused(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(1)}, tmp_path / "model.safetensors")
    with pytest.raises(OutputExistsError, match="holds the input"):
        write_tensors(
            tmp_path,
            {"a": torch.zeros(1)},
            overwrite=True,
            protect=[tmp_path / "model.safetensors"],
        )
    with pytest.raises(OutputExistsError, match="holds the input"):
        write_tensors(
            tmp_path.parent,
            {"a": torch.zeros(1)},
            overwrite=True,
            protect=[tmp_path / "model.safetensors"],
        )
    assert load_file(tmp_path / "model.safetensors")["a"].shape == (1,)


def test_exception_leaves_nothing(tmp_path: Path) -> None:
    spec = TensorSpec("a", "F32", (4,))
    with pytest.raises(RuntimeError, match="boom"), CheckpointWriter(tmp_path / "out", [spec]):
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_incomplete_write_is_not_committed(tmp_path: Path) -> None:
    spec = TensorSpec("a", "F32", (4,))
    with (
        pytest.raises(ExecutionError, match="not written in full"),
        CheckpointWriter(tmp_path / "out", [spec]) as w,
    ):
        w.write("a", b"\0" * 8)
    assert list(tmp_path.iterdir()) == []


def test_write_outside_tensor_refused(tmp_path: Path) -> None:
    spec = TensorSpec("a", "F32", (2,))
    w = CheckpointWriter(tmp_path / "out", [spec])
    w.open()
    with pytest.raises(ValueError, match="outside tensor 'a'"):
        w.write("a", b"\0" * 8, offset=4)
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_duplicate_output_names_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="repeat: a"):
        CheckpointWriter(tmp_path / "out", [TensorSpec("a", "U8", (1,))] * 2)


def test_destination_created_meanwhile_wins(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    spec = TensorSpec("a", "U8", (1,))
    w = CheckpointWriter(dest, [spec])
    w.open()
    w.write("a", b"\1")
    write_tensors(dest, {"b": torch.zeros(1)})  # another run finishes first
    with pytest.raises(OutputExistsError, match="appeared"):
        w.commit()
    assert sorted(Checkpoint.open(dest)) == ["b"]
    assert not list(tmp_path.glob(f"*{TMP_MARKER}*"))


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("5GB", 5 * 10**9),
        ("500MB", 5 * 10**8),
        ("2GiB", 2 * 2**30),
        ("100", 100),
        ("1.5kb", 1500),
        (" 7 B ", 7),
        (42, 42),
    ],
)
def test_parse_size(text: str | int, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["5XB", "GB", "-1GB", "0", "", "1e9"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def _direct_supported(folder: Path) -> bool:
    from weightmap.format.transfer import open_direct

    probe = folder / "probe"
    probe.write_bytes(b"")
    fd = open_direct(probe)
    probe.unlink()
    if fd is None:
        return False
    os.close(fd)
    return True


@pytest.mark.parametrize("direct", ["1", "0"])
def test_large_chunks_in_any_order_and_phase_give_the_reference_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: str
) -> None:
    """Chunks of a megabyte and more, at offsets and from memory in every position relative to
    a disk block (bytes, unaligned views, views placed by ``phase``), written by four threads
    in a shuffled order: the bytes of the reference, direct I/O on or off (the default)."""
    monkeypatch.setenv("WEIGHTMAP_DIRECT_IO", direct)
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(1000, 1031), "c": torch.randn(777, 999)}
    specs = [_spec(n, t) for n, t in tensors.items()]
    rng = random.Random(0)
    jobs = []
    for name, t in tensors.items():
        raw = _raw(t)
        cuts = sorted({0, len(raw), *(rng.randrange(len(raw)) for _ in range(3))})
        jobs += [(name, raw, lo, hi) for lo, hi in pairwise(cuts)]
    rng.shuffle(jobs)
    with CheckpointWriter(tmp_path / "out", specs) as w:

        def put(job: tuple[str, bytes, int, int]) -> None:
            name, raw, lo, hi = job
            if lo % 2:  # from bytes (read-only memory)
                w.write(name, raw[lo:hi], lo)
                return
            # From writable memory placed where the chunk lands in its block, or one byte off.
            room = bytearray(hi - lo + 8192)
            base = torch.frombuffer(room, dtype=torch.uint8).data_ptr()
            shift = (w.phase(name, lo) - base) % 4096 + (lo % 4 == 2)
            view = memoryview(room)[shift : shift + hi - lo]
            view[:] = raw[lo:hi]
            w.write(name, view, lo)

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(put, jobs))
        used = w._directs.used()
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == save(tensors)
    if direct == "1" and _direct_supported(tmp_path):
        assert used, "no chunk went to the disk directly"
    if direct == "0":
        assert not used


def test_a_refused_direct_write_is_written_through_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem that refuses direct I/O of the blocks (EINVAL): the chunk is written
    through the page cache, and so is every later one of that shard."""
    if not _direct_supported(tmp_path):
        pytest.skip("this filesystem has no direct I/O")
    calls = []

    def refuse(*args: object) -> None:
        calls.append(args)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setenv("WEIGHTMAP_DIRECT_IO", "1")
    monkeypatch.setattr(transfer_module, "pwrite_direct", refuse)
    tensors = {"w": torch.randn(1024, 1024)}
    raw = _raw(tensors["w"])
    half = len(raw) // 2
    with CheckpointWriter(tmp_path / "out", [_spec("w", tensors["w"])]) as w:
        w.write("w", raw[:half], 0)
        w.write("w", raw[half:], half)
    assert len(calls) == 1
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == save(tensors)


def test_direct_io_is_opt_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEIGHTMAP_DIRECT_IO", raising=False)
    w = CheckpointWriter(tmp_path / "out", [TensorSpec("w", "F32", (2,))])
    assert not w.direct_io
    monkeypatch.setenv("WEIGHTMAP_DIRECT_IO", "1")
    assert CheckpointWriter(tmp_path / "out", [TensorSpec("w", "F32", (2,))]).direct_io
