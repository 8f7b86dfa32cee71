"""The distributed executor without a cluster: the work split, the tasks, the driver's checks.

Tasks are run in this process, in any order and some of them twice (as Ray runs a task again
after its worker died), and the output must be byte for byte the local executor's whatever
the split. ``test_ray.py`` runs the same on a Ray cluster.
"""

from __future__ import annotations

import itertools
import os
import pickle
import random
import re
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import weightmap
from strategies import UNFIT, cases, rule_programs
from weightmap.errors import CheckpointError, ExecutionError, FormatError
from weightmap.execute.distributed import Runner, crc32_combine, execute_tasks
from weightmap.execute.partition import ComputeUnit, TaskReport, TaskSpec, partition
from weightmap.execute.sources import plan_writer
from weightmap.execute.streaming import ExecutionStats, ProgressFn, execute
from weightmap.execute.task import run_task
from weightmap.format.layout import Layouts
from weightmap.fs.atomic import TMP_MARKER, host_name, owner_tag, stale_temporaries
from weightmap.inputs.checkpoint import Checkpoint
from weightmap.language.ast import Loc
from weightmap.plan.nodes import Node
from weightmap.plan.plan import OutputTensor, Plan


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """Every file of an output folder, by name."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def in_process(seed: int, repeat: float = 0.0) -> Runner:
    """A runner that runs the tasks here, shuffled, a share ``repeat`` of them twice."""

    def run(tasks: list[TaskSpec], progress: ProgressFn | None) -> list[TaskReport]:
        order = list(tasks)
        rng = random.Random(seed)
        rng.shuffle(order)
        reports = []
        for spec in order:
            if rng.random() < repeat:
                run_task(spec)  # an attempt whose report is lost, as after a crash
            reports.append(run_task(spec, progress))
        return reports

    return run


def run_both(
    root: Path,
    plan: Plan,
    *,
    layout: Layouts = "clone",
    seed: int = 0,
    task_cost: int | None = None,
    chunk_bytes: int = 1 << 20,
    max_shard_size: str = "5GB",
) -> tuple[ExecutionStats, ExecutionStats]:
    """The local executor into root/local, tasks run here into root/tasks; their stats."""
    common = {"layout": layout, "chunk_bytes": chunk_bytes, "max_shard_size": max_shard_size}
    with Checkpoint.open(root) as ckpt:
        _, local = execute(plan, ckpt, root / "local", checksum=True, **common)  # type: ignore[arg-type]
    with Checkpoint.open(root) as ckpt:
        _, tasks = execute_tasks(
            plan,
            ckpt,
            root / "tasks",
            run=in_process(seed, 0.3),
            slots=2,
            checksum=True,
            task_cost=task_cost,
            **common,  # type: ignore[arg-type]
        )
    return local, tasks


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    case=rule_programs(),
    task_cost=st.sampled_from([1, 7, 64, 500, None]),
    chunk=st.sampled_from([3, 64, 1 << 20]),
    shard=st.sampled_from(["100B", "5GB"]),
    seed=st.integers(0, 2**16),
)
def test_tasks_equal_local_whatever_the_split(
    tmp_path_factory: pytest.TempPathFactory,
    layout: Layouts,
    case: tuple[dict[str, torch.Tensor], str],
    task_cost: int | None,
    chunk: int,
    shard: str,
    seed: int,
) -> None:
    tensors, program = case
    root = tmp_path_factory.mktemp("d")
    save_file(tensors, root / "model.safetensors")
    plan = weightmap.compile(root, mapping=program)
    local, tasks = run_both(
        root,
        plan,
        layout=layout,
        seed=seed,
        task_cost=task_cost,
        chunk_bytes=chunk,
        max_shard_size=shard,
    )
    assert folder_bytes(root / "tasks") == folder_bytes(root / "local"), program
    assert tasks == local, program  # bytes by kind and every checksum
    assert not [p for p in root.iterdir() if TMP_MARKER in p.name]


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    case=cases(),
    task_cost=st.sampled_from([1, 7, 64, None]),
    chunk=st.sampled_from([1, 7, 1 << 20]),
    seed=st.integers(0, 2**16),
)
def test_tasks_equal_local_on_generated_nodes(
    tmp_path_factory: pytest.TempPathFactory,
    case: tuple[dict[str, torch.Tensor], dict[str, Node]],
    task_cost: int | None,
    chunk: int,
    seed: int,
) -> None:
    """Chains of slices, concatenations, stacks, permutes, reshapes, casts and arithmetic
    straight from plan nodes (every dtype, empty tensors): the same bytes, or (a narrowing
    cast meeting a value it cannot hold) the same stop."""
    inputs, outputs = case
    root = tmp_path_factory.mktemp("n")
    save_file(inputs, root / "model.safetensors")
    with Checkpoint.open(root) as ckpt:
        specs = ckpt.specs()
    plan = Plan.build(
        mapping_name="test",
        inputs=specs,
        outputs=tuple(
            OutputTensor(name=n, node=node, origin=Loc("<test>", 1, 1))
            for n, node in outputs.items()
        ),
    )
    try:
        local, by_tasks = run_both(
            root, plan, seed=seed, task_cost=task_cost, chunk_bytes=chunk, max_shard_size="64B"
        )
    except ExecutionError as e:
        # A narrowing cast met a value it cannot hold: the tasks stop too, leaving nothing.
        assert re.search(UNFIT, str(e)), e
        with Checkpoint.open(root) as ckpt, pytest.raises(ExecutionError, match=UNFIT):
            execute_tasks(plan, ckpt, root / "tasks", run=in_process(seed, 0.3), slots=2,
                          task_cost=task_cost, chunk_bytes=chunk, max_shard_size="64B")  # fmt: skip
        assert sorted(p.name for p in root.iterdir()) == ["model.safetensors"]
        return
    assert folder_bytes(root / "tasks") == folder_bytes(root / "local")
    assert by_tasks == local


def split(
    root: Path, plan: Plan, max_shard_size: str = "5GB", **options: object
) -> tuple[list[TaskSpec], list[tuple[int, int]]]:
    """The tasks ``partition`` makes of ``plan`` over the checkpoint in ``root``, and the
    output shards' (header size, file size)."""
    with Checkpoint.open(root) as ckpt:
        writer, sources = plan_writer(plan, ckpt, root / "out", max_shard_size=max_shard_size)
        writer.open()
        try:
            tasks = partition(plan, sources, writer, ckpt.headers, **options)  # type: ignore[arg-type]
        finally:
            writer.abort()
    sizes = [s.size for s in writer.shards]
    return tasks, list(zip(writer.data_starts, sizes, strict=True))


def _checkpoint(root: Path) -> Plan:
    """A cast of one large tensor, a large copied one and a small one."""
    root.mkdir(exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    save_file(
        {
            "a": torch.randn(256, 64, generator=gen),
            "b": torch.randn(1000, 10, generator=gen),
            "c": torch.randn(3, generator=gen),
        },
        root / "model.safetensors",
    )
    return weightmap.compile(root, mapping='weightmap 1\ncast "a" to bf16\nunmatched keep\n')


def test_huge_tensor_split_by_rows_and_shard_by_byte_ranges(tmp_path: Path) -> None:
    plan = _checkpoint(tmp_path)
    tasks, shards = split(tmp_path, plan, slots=2, chunk_bytes=1024, checksum=True, task_cost=4096)
    rows = sorted(c.rows for t in tasks for c in t.computes if c.name == "a")
    assert len({t.index for t in tasks if t.computes}) > 1
    assert rows[0] is not None and rows[0][0] == 0 and rows[-1] is not None
    assert all(a[1] == b[0] for a, b in itertools.pairwise(rows))  # type: ignore[index]
    assert rows[-1][1] == 256
    # the copied tensor's one shard, in byte ranges over several tasks
    assert len({t.index for t in tasks if t.copies}) > 1
    # every data byte of the shard planned once
    assert sum(t.planned.get(0, 0) for t in tasks) == shards[0][1] - shards[0][0]
    # costs are balanced: no task more than twice the target
    assert max(t.cost for t in tasks) <= 2 * 4096
    local, by_tasks = run_both(tmp_path, plan, task_cost=4096, chunk_bytes=1024)
    assert folder_bytes(tmp_path / "tasks") == folder_bytes(tmp_path / "local")
    assert by_tasks == local


@pytest.mark.parametrize(
    "mapping", ['cast "{n*}" to F32 where dtype == "BF16"\nunmatched keep', "unmatched keep"]
)
def test_tasks_read_pytorch_checkpoints_as_the_driver(tmp_path: Path, mapping: str) -> None:
    """A pytorch_model.bin: its byte ranges are the archive's (no safetensors header before
    them) and a strided tensor is read through its view, on every node as on the driver."""
    gen = torch.Generator().manual_seed(2)
    state = {
        "a": torch.randn(64, 32, generator=gen).to(torch.bfloat16),
        "t": torch.randn(32, 48, generator=gen).t(),  # strided in its storage
        "c": torch.randn(3, generator=gen),
    }
    torch.save(state, tmp_path / "pytorch_model.bin")
    plan = weightmap.compile(tmp_path, mapping=f"weightmap 1\n{mapping}\n")
    local, by_tasks = run_both(tmp_path, plan, task_cost=1024, chunk_bytes=1024)
    assert folder_bytes(tmp_path / "tasks") == folder_bytes(tmp_path / "local")
    assert by_tasks == local
    with Checkpoint.open(tmp_path / "tasks") as out:
        for name, t in state.items():
            expected = t.float() if t.dtype == torch.bfloat16 and "cast" in mapping else t
            assert torch.equal(out.view(name), expected), name


def test_tasks_are_balanced_by_cost(tmp_path: Path) -> None:
    """Many shards of unequal sizes: each of the 4 x slots tasks gets about its share."""
    tmp_path.mkdir(exist_ok=True)
    gen = torch.Generator().manual_seed(1)
    sizes = [int(s) for s in torch.randint(100, 4000, (40,), generator=gen)]
    save_file(
        {f"t{i:02d}": torch.randn(n, generator=gen) for i, n in enumerate(sizes)},
        tmp_path / "model.safetensors",
    )
    plan = weightmap.compile(
        tmp_path, mapping='weightmap 1\ncast "t0{i}" to bf16\nunmatched keep\n'
    )
    tasks, shards = split(tmp_path, plan, "8KB", slots=3, chunk_bytes=1 << 20, checksum=False)
    assert len(shards) > 5 and len(tasks) == 1  # under 64 MiB: one task
    data = sum(size - header for header, size in shards)
    tasks, _ = split(
        tmp_path,
        plan,
        "8KB",
        slots=3,
        chunk_bytes=1 << 20,
        checksum=False,
        task_cost=data // 12,
    )
    costs = sorted(t.cost for t in tasks)
    assert len(tasks) >= 12
    assert costs[-1] <= 2 * costs[len(costs) // 2], costs


@given(a=st.binary(max_size=300), b=st.binary(max_size=300), c=st.binary(max_size=3000))
def test_crc32_combine_matches_zlib(a: bytes, b: bytes, c: bytes) -> None:
    ab = crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b))
    assert ab == zlib.crc32(a + b)
    assert crc32_combine(ab, zlib.crc32(c), len(c)) == zlib.crc32(a + b + c)


def test_errors_cross_processes_as_they_are() -> None:
    """A task's error is pickled to the driver: the same text, fields and type."""
    for exc in [
        FormatError("file changed", path="/x/m.safetensors", tensor="t", rule="changed"),
        CheckpointError("bad index", path="/x", rule="index"),
        ExecutionError("/x: writing failed (No space); nothing was written under that name"),
    ]:
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc)
        if isinstance(exc, FormatError):
            assert isinstance(back, FormatError)
            assert (back.path, back.tensor, back.rule) == (exc.path, exc.tensor, exc.rule)


def test_temporaries_of_another_host_or_container_are_never_stale(tmp_path: Path) -> None:
    """A temporary's name carries its writer's host and pid namespace: its pid is checked
    there only, so `weightmap clean` on another node, or in another container sharing the
    volume (its own pids, often the same host name), never removes a live conversion's folder.
    Names of earlier versions (a pid alone, or with a host alone) are judged as they were."""
    here = owner_tag().partition("@")[2]
    host = host_name()
    assert here.startswith(f"{host}+")  # Linux: the namespace is known
    other_host = tmp_path / f".out{TMP_MARKER}999999999@another.host+4026531836-abcd"
    other_container = tmp_path / f".out{TMP_MARKER}999999999@{host}+1-abcd"
    dead_here = tmp_path / f".out{TMP_MARKER}999999999@{here}-abcd"
    alive_here = tmp_path / f".out{TMP_MARKER}{os.getpid()}@{here}-abcd"
    legacy_dead = tmp_path / f".out{TMP_MARKER}999999999-abcd"
    legacy_host_dead = tmp_path / f".out{TMP_MARKER}999999999@{host}-abcd"
    legacy_alive = tmp_path / f".out{TMP_MARKER}{os.getpid()}-abcd"
    for p in (other_host, other_container, dead_here, alive_here):
        p.mkdir()
    for p in (legacy_dead, legacy_host_dead, legacy_alive):
        p.mkdir()
    expected = sorted([dead_here, legacy_dead, legacy_host_dead])
    assert stale_temporaries(tmp_path) == expected
    assert stale_temporaries(tmp_path, "out") == expected
    assert stale_temporaries(tmp_path, "other") == []


def test_temporaries_where_the_namespace_is_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that cannot read its pid namespace says so (``+0``), rather than writing the
    bare host of earlier versions: its pid is judged only where the namespace is unknown too.
    A destination whose own name holds the marker is parsed from the last one."""
    from weightmap.fs import atomic

    host = host_name()
    unknown_dead = tmp_path / f".out{TMP_MARKER}999999999@{host}+0-abcd"
    unknown_dead.mkdir()
    assert stale_temporaries(tmp_path) == []  # this process knows its namespace
    monkeypatch.setattr(atomic, "_pid_namespace", lambda: "0")
    assert owner_tag() == f"{os.getpid()}@{host}+0"
    assert stale_temporaries(tmp_path) == [unknown_dead]
    monkeypatch.undo()
    unknown_dead.rmdir()
    odd = f"out{TMP_MARKER}1"
    alive = tmp_path / f".{odd}{TMP_MARKER}{owner_tag()}-abcd"
    alive.mkdir()
    assert stale_temporaries(tmp_path) == []
    assert stale_temporaries(tmp_path, odd) == []
    assert stale_temporaries(tmp_path, "out") == []


def test_failed_task_leaves_nothing(tmp_path: Path) -> None:
    plan = _checkpoint(tmp_path)

    def failing(tasks: list[TaskSpec], progress: object) -> list[TaskReport]:
        reports = [run_task(t) for t in tasks[1:]]
        raise ExecutionError("boom")
        return reports

    with Checkpoint.open(tmp_path) as ckpt, pytest.raises(ExecutionError, match="boom"):
        execute_tasks(plan, ckpt, tmp_path / "out", run=failing, slots=2, task_cost=4096)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if TMP_MARKER in p.name]


def test_missing_or_miscounted_task_is_refused(tmp_path: Path) -> None:
    plan = _checkpoint(tmp_path)

    def lose_one(tasks: list[TaskSpec], progress: object) -> list[TaskReport]:
        return [run_task(t) for t in tasks[1:]]

    def miscount(tasks: list[TaskSpec], progress: object) -> list[TaskReport]:
        reports = [run_task(t) for t in tasks]
        first = reports[0]
        written = {s: n - 1 for s, n in first.written.items()}
        return [TaskReport(first.index, first.host, written), *reports[1:]]

    for runner, message in [(lose_one, "did not report"), (miscount, "other byte counts")]:
        with Checkpoint.open(tmp_path) as ckpt, pytest.raises(ExecutionError, match=message):
            execute_tasks(plan, ckpt, tmp_path / "out", run=runner, slots=2, task_cost=4096)
        assert not (tmp_path / "out").exists()
        assert not [p for p in tmp_path.iterdir() if TMP_MARKER in p.name]


def _one_task(tmp_path: Path) -> tuple[TaskSpec, Path]:
    """A task of a conversion whose temporary folder stays open, and that folder."""
    plan = _checkpoint(tmp_path)
    with Checkpoint.open(tmp_path) as ckpt:
        writer, sources = plan_writer(plan, ckpt, tmp_path / "out")
        writer.open()
        tasks = partition(
            plan, sources, writer, ckpt.headers, slots=1, chunk_bytes=1 << 20, checksum=False
        )
    assert writer.tmp is not None and owner_tag() in writer.tmp.name
    return tasks[0], writer.tmp


def test_task_on_a_node_without_the_files(tmp_path: Path) -> None:
    spec, folder = _one_task(tmp_path)
    moved = tmp_path / "moved"
    folder.rename(moved)
    with pytest.raises(ExecutionError, match="every node mounts at the same path"):
        run_task(spec)
    moved.rename(folder)
    (tmp_path / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    with pytest.raises(ExecutionError, match="every node mounts at the same path"):
        run_task(spec)


def test_task_refuses_changed_input_and_other_code(tmp_path: Path) -> None:
    spec, _ = _one_task(tmp_path)
    from dataclasses import replace

    with pytest.raises(ExecutionError, match="other weightmap code than the driver"):
        run_task(replace(spec, code="0" * 16))
    os.utime(tmp_path / "model.safetensors", ns=(0, 0))
    with pytest.raises(FormatError, match=r"file changed while the conversion ran.*\[changed\]"):
        run_task(spec)


def test_compute_units_start_on_chunk_boundaries(tmp_path: Path) -> None:
    """Row ranges start at multiples of the chunk step: a task computes the very chunks the
    local executor computes (a block quantization never cuts a block)."""
    plan = weightmap.compile(
        _quant(tmp_path),
        mapping='weightmap 1\nquantize "w.weight" to fp8_e4m3 block [3, 4] -> "w.q", "w.s"\n',
    )
    tasks, _ = split(tmp_path, plan, slots=2, chunk_bytes=200, checksum=False, task_cost=64)
    units = [c for t in tasks for c in t.computes if isinstance(c, ComputeUnit) and c.rows]
    assert units and all(c.rows[0] % 3 == 0 for c in units if c.name == "w.q")  # type: ignore[index]
    local, by_tasks = run_both(tmp_path, plan, task_cost=64, chunk_bytes=200)
    assert folder_bytes(tmp_path / "tasks") == folder_bytes(tmp_path / "local")
    assert by_tasks == local


def _quant(root: Path) -> Path:
    root.mkdir(exist_ok=True)
    save_file(
        {"w.weight": torch.randn(30, 8, generator=torch.Generator().manual_seed(2))},
        root / "model.safetensors",
    )
    return root


def test_plan_without_bytes_needs_no_task(tmp_path: Path) -> None:
    save_file({"e": torch.zeros(0, 3), "f": torch.zeros(2, 0)}, tmp_path / "model.safetensors")
    plan = weightmap.compile(tmp_path, mapping='weightmap 1\ncast "e" to bf16\nunmatched keep\n')
    tasks, _ = split(tmp_path, plan, slots=2, chunk_bytes=1 << 20, checksum=True)
    assert tasks == []
    local, by_tasks = run_both(tmp_path, plan)
    assert folder_bytes(tmp_path / "tasks") == folder_bytes(tmp_path / "local")
    assert by_tasks == local


@pytest.mark.parametrize("direct", ["1", "0"])
def test_tasks_write_past_the_page_cache_as_the_driver_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: str
) -> None:
    """``WEIGHTMAP_DIRECT_IO`` is read by the driver and carried to the tasks (a node's own
    environment may lack it): their chunks of a megabyte and more go past the page cache as
    the local writer's do, and the bytes are the same either way."""
    from weightmap.format import transfer

    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(1024, 1024, generator=gen), "c": torch.randn(3, generator=gen)}
    save_file(tensors, tmp_path / "model.safetensors")
    plan = weightmap.compile(tmp_path, mapping='weightmap 1\ncast "a" to bf16\nunmatched keep\n')
    sizes: list[int] = []
    real = transfer.pwrite_direct

    def counted(
        fd: int, direct_fd: int, data: bytes | memoryview, at: int, stage: memoryview
    ) -> None:
        sizes.append(memoryview(data).nbytes)
        real(fd, direct_fd, data, at, stage)

    monkeypatch.setattr(transfer, "pwrite_direct", counted)
    monkeypatch.setenv("WEIGHTMAP_DIRECT_IO", direct)
    seen: list[bool] = []

    def on_a_node(tasks: list[TaskSpec], progress: ProgressFn | None) -> list[TaskReport]:
        seen.extend(t.direct_io for t in tasks)
        monkeypatch.delenv("WEIGHTMAP_DIRECT_IO")
        return in_process(0)(tasks, progress)

    with Checkpoint.open(tmp_path) as ckpt:
        execute_tasks(plan, ckpt, tmp_path / "tasks", run=on_a_node, slots=2, chunk_bytes=8 << 20)
    assert seen and set(seen) == {direct == "1"}
    with Checkpoint.open(tmp_path) as ckpt:
        execute(plan, ckpt, tmp_path / "local", chunk_bytes=8 << 20)
    assert folder_bytes(tmp_path / "tasks") == folder_bytes(tmp_path / "local")
    probe = transfer.open_direct(tmp_path / "model.safetensors")
    if probe is not None:
        os.close(probe)
    if direct == "0" or probe is None:
        assert not sizes
    else:
        assert sizes and all(n >= transfer.DIRECT_MIN for n in sizes)


def test_a_task_reads_a_pickle_through_its_one_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task opens each input once and reads a PyTorch file's tensors through that open: it
    kept the tensors it read, where it used to load them again by name for a computed output
    (and a file swapped meanwhile for one of the same size and time reached the output)."""
    import weightmap.inputs.checkpoint as checkpoint_module

    root = tmp_path / "pt"
    root.mkdir()
    torch.save({"a": torch.arange(16.0), "b": torch.ones(4)}, root / "pytorch_model.bin")
    plan = weightmap.compile(root, mapping='weightmap 1\ncast "a" to bf16\nunmatched keep\n')
    loads: list[object] = []
    real = checkpoint_module.read_pickle

    def counted(*args: object, **kwargs: object) -> object:
        loads.append(args)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    with Checkpoint.open(root) as ckpt:
        monkeypatch.setattr(checkpoint_module, "read_pickle", counted)
        execute_tasks(plan, ckpt, root.parent / "tasks", run=in_process(0), slots=2)
    assert loads == []  # (the task's own read, through its descriptor, was kept)
    out = weightmap.Checkpoint.open(root.parent / "tasks")
    assert torch.equal(out.view("a"), torch.arange(16.0).to(torch.bfloat16))
