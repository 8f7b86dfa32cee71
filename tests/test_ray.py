"""The executor on a Ray cluster (a local one of 2 CPUs, started once for this module).

Its output must be byte for byte the local executor's for any plan and any split of the work,
also after a worker is killed in the middle of a task, and on copy-on-write filesystems where
the tasks clone; a task that fails for good fails the conversion with the local executor's
error and leaves nothing behind.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import weightmap
from strategies import rule_programs
from test_distributed import folder_bytes
from weightmap import cli
from weightmap.errors import ExecutionError, FormatError
from weightmap.execute import cluster as cluster_module
from weightmap.execute import task as task_module
from weightmap.execute.cluster import execute_on_ray
from weightmap.execute.partition import TaskReport, TaskSpec
from weightmap.execute.streaming import ExecutionStats, execute
from weightmap.format.layout import Layouts
from weightmap.format.transfer import open_direct
from weightmap.fs.atomic import TMP_MARKER
from weightmap.inputs.checkpoint import Checkpoint
from weightmap.plan.plan import Plan

from conftest import cow_mount, cowfs

SRC = Path(weightmap.__file__).resolve().parent
Report = Callable[[int], None] | None


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[None]:
    """A local cluster for these tests; its workers import this weightmap."""
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        runtime_env={"env_vars": {"PYTHONPATH": str(SRC.parent)}},
    )

    @ray.remote
    def where() -> str:
        import weightmap as imported

        return str(Path(imported.__file__).resolve().parent)

    assert ray.get(where.remote()) == str(SRC)
    yield
    ray.shutdown()


def local_and_ray(
    root: Path,
    plan: Plan,
    layout: Layouts = "clone",
    *,
    chunk_bytes: int = 1 << 20,
    max_shard_size: str = "5GB",
    **options: Any,
) -> tuple[ExecutionStats, ExecutionStats]:
    """The local executor into root/local and the Ray executor into root/ray; their stats."""
    common: dict[str, Any] = {
        "checksum": True,
        "layout": layout,
        "max_shard_size": max_shard_size,
        "chunk_bytes": chunk_bytes,
    }
    with Checkpoint.open(root) as ckpt:
        _, local = execute(plan, ckpt, root / "local", **common)
    with Checkpoint.open(root) as ckpt:
        _, remote = execute_on_ray(plan, ckpt, root / "ray", **common, **options)
    return local, remote


def leftovers(root: Path) -> list[str]:
    return [p.name for p in root.iterdir() if TMP_MARKER in p.name]


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    case=rule_programs(),
    task_cost=st.sampled_from([1, 64, None]),
    workers=st.sampled_from([1, 2]),
    shard=st.sampled_from(["100B", "5GB"]),
)
def test_ray_equals_local_whatever_the_split(
    tmp_path_factory: pytest.TempPathFactory,
    layout: Layouts,
    case: tuple[dict[str, torch.Tensor], str],
    task_cost: int | None,
    workers: int,
    shard: str,
) -> None:
    tensors, program = case
    root = tmp_path_factory.mktemp("r")
    save_file(tensors, root / "model.safetensors")
    plan = weightmap.compile(root, mapping=program)
    local, remote = local_and_ray(
        root,
        plan,
        layout,
        task_cost=task_cost,
        workers=workers,
        max_shard_size=shard,
        chunk_bytes=3,
    )
    assert folder_bytes(root / "ray") == folder_bytes(root / "local"), program
    assert remote == local, program  # bytes by kind and every checksum
    assert leftovers(root) == []


def _checkpoint(root: Path) -> Plan:
    root.mkdir(exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    save_file(
        {"a": torch.randn(256, 64, generator=gen), "b": torch.randn(1000, 10, generator=gen)},
        root / "model.safetensors",
    )
    (root / "config.json").write_text('{"torch_dtype": "float32"}')
    return weightmap.compile(root, mapping='weightmap 1\ncast "a" to bf16\nunmatched keep\n')


def test_killed_worker_is_retried_and_the_bytes_are_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first attempt of one task writes its share, scribbles over it, and kills its own
    worker; Ray runs the task again, which writes the same bytes at the same offsets. Bytes,
    counts, checksums and the progress are those of an undisturbed run."""
    plan = _checkpoint(tmp_path)
    marker = tmp_path / "killed-once"
    run_task = task_module.run_task

    def dies_once(spec: TaskSpec, report: Report) -> TaskReport:
        if spec.index == 0 and not marker.exists():
            marker.touch()
            run_task(spec, report)
            for shard, offset, length in [(p.shard, p.dst, p.length) for p in spec.copies] + [
                (spec.targets[c.name][0], spec.targets[c.name][1] + c.offset, c.length)
                for c in spec.computes
            ]:
                fd = os.open(Path(spec.folder) / spec.shards[shard], os.O_WRONLY)
                os.pwrite(fd, b"\xff" * length, offset)
                os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)
        return run_task(spec, report)

    monkeypatch.setattr(task_module, "run_task", dies_once)
    seen: list[int] = []
    local, remote = local_and_ray(
        tmp_path, plan, task_cost=8192, chunk_bytes=1024, progress=seen.append
    )
    assert marker.exists()
    assert folder_bytes(tmp_path / "ray") == folder_bytes(tmp_path / "local")
    assert remote == local
    assert sum(seen) == sum(s.nbytes for s in plan.output_specs())
    assert leftovers(tmp_path) == []


def test_direct_writes_reach_the_tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``WEIGHTMAP_DIRECT_IO=1`` where the conversion starts (the workers' environment lacks
    it): the tasks send their chunks of a megabyte and more past the page cache, and the bytes
    are the local executor's."""
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(1024, 1024, generator=gen), "b": torch.randn(3, generator=gen)}
    save_file(tensors, tmp_path / "model.safetensors")
    plan = weightmap.compile(tmp_path, mapping='weightmap 1\ncast "a" to bf16\nunmatched keep\n')
    marks = tmp_path / "marks"
    marks.mkdir()
    run_task = task_module.run_task

    def watched(spec: TaskSpec, report: Report) -> TaskReport:
        from weightmap.format import transfer

        real = transfer.pwrite_direct
        calls: list[int] = []

        def counted(*args: Any) -> None:
            calls.append(1)
            real(*args)

        transfer.pwrite_direct = counted
        try:
            done = run_task(spec, report)
        finally:
            transfer.pwrite_direct = real
        (marks / f"{spec.index}-{spec.direct_io}-{len(calls)}").touch()
        if "WEIGHTMAP_DIRECT_IO" in os.environ:
            (marks / "worker-env").touch()
        return done

    monkeypatch.setattr(task_module, "run_task", watched)
    monkeypatch.setenv("WEIGHTMAP_DIRECT_IO", "1")
    local, remote = local_and_ray(tmp_path, plan, chunk_bytes=8 << 20)
    assert folder_bytes(tmp_path / "ray") == folder_bytes(tmp_path / "local")
    assert remote == local
    seen = sorted(p.name for p in marks.iterdir())
    assert "worker-env" not in seen and all(name.split("-")[1] == "True" for name in seen)
    probe = open_direct(tmp_path / "model.safetensors")
    if probe is not None:
        os.close(probe)
        assert sum(int(name.split("-")[2]) for name in seen) > 0, seen


def test_worker_that_always_dies_fails_the_conversion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _checkpoint(tmp_path)

    def dies(spec: TaskSpec, report: Report) -> TaskReport:
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")

    monkeypatch.setattr(task_module, "run_task", dies)
    with Checkpoint.open(tmp_path) as ckpt, pytest.raises(ExecutionError) as info:
        execute_on_ray(plan, ckpt, tmp_path / "out", max_retries=1)
    assert str(info.value).startswith(f"{tmp_path / 'out'}: a task failed 2 times")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_changed_input_fails_as_locally(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An input rewritten while tasks run: the task's error is the local executor's."""
    plan = _checkpoint(tmp_path)
    shard = tmp_path / "model.safetensors"
    run_task = task_module.run_task

    def after_a_change(spec: TaskSpec, report: Report) -> TaskReport:
        os.utime(spec.inputs[0].path, ns=(10**9, 10**9))
        return run_task(spec, report)

    monkeypatch.setattr(task_module, "run_task", after_a_change)
    with Checkpoint.open(tmp_path) as ckpt:
        os.utime(shard, ns=(0, 0))  # the same change, seen by the local executor
        with pytest.raises(FormatError) as local:
            execute(plan, ckpt, tmp_path / "out")
    with Checkpoint.open(tmp_path) as ckpt, pytest.raises(FormatError) as remote:
        execute_on_ray(plan, ckpt, tmp_path / "out")
    assert str(remote.value) == str(local.value)
    assert remote.value.rule == "changed"
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_full_disk_fails_as_locally(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC from a write in a task: the local executor's one-line error, nothing left."""
    plan = _checkpoint(tmp_path)
    run_task = task_module.run_task
    pwrite = os.pwrite

    def full(fd: int, data: bytes, offset: int) -> int:
        if offset == 0:  # the headers, which the driver writes: the data does not fit
            return pwrite(fd, data, offset)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def on_a_full_disk(spec: TaskSpec, report: Report) -> TaskReport:
        os.pwrite = full  # type: ignore[assignment]  # this worker, for this task only
        try:
            return run_task(spec, report)
        finally:
            os.pwrite = pwrite

    with Checkpoint.open(tmp_path) as ckpt:
        monkeypatch.setattr(os, "pwrite", full)
        with pytest.raises(ExecutionError) as local:
            execute(plan, ckpt, tmp_path / "out")
        monkeypatch.undo()
    monkeypatch.setattr(task_module, "run_task", on_a_full_disk)
    with Checkpoint.open(tmp_path) as ckpt, pytest.raises(ExecutionError) as remote:
        execute_on_ray(plan, ckpt, tmp_path / "out")
    assert str(remote.value) == str(local.value)
    assert "No space left on device" in str(remote.value) and "\n" not in str(remote.value)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_remap_and_cli_on_ray(tmp_path: Path, example: Path) -> None:
    """The same API and command line, joined to the running cluster; verify included."""
    local = weightmap.remap(example, tmp_path / "local", preset="eagle3-sglang", verify=True)
    remote = weightmap.remap(
        example, tmp_path / "ray", preset="eagle3-sglang", verify=True, executor="ray"
    )
    assert folder_bytes(tmp_path / "ray") == folder_bytes(tmp_path / "local")
    assert remote.checksums == local.checksums and remote.verified
    code = cli.main(
        [
            "convert",
            str(example),
            str(tmp_path / "cli"),
            "--preset",
            "eagle3-sglang",
            "--ray",
            "--quiet",
            "--verify",
        ]
    )
    assert code == 0
    assert folder_bytes(tmp_path / "cli") == folder_bytes(tmp_path / "local")
    assert ray.is_initialized()  # a cluster the caller started is left running


def test_relative_paths_reach_workers_in_another_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Paths as a user types them, relative to the driver's folder: the workers run in the
    folder their cluster started in (another one here, as for any cluster started with
    `ray start`), yet read the same input and write the same output."""
    root = tmp_path / "in"
    _checkpoint(root)
    (root / "tokenizer.json").write_text("{}")
    mapping = 'weightmap 1\ncast "a" to bf16\nunmatched keep\n'
    local = weightmap.remap(root, tmp_path / "local", mapping=mapping, progress=False)
    monkeypatch.chdir(tmp_path)
    remote = weightmap.remap(
        "in", "ray", mapping=mapping, executor="ray", verify=True, progress=False
    )
    assert folder_bytes(tmp_path / "ray") == folder_bytes(tmp_path / "local")
    assert remote.bytes_computed == local.bytes_computed and leftovers(tmp_path) == []


def test_ray_missing_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _checkpoint(tmp_path)
    text = 'weightmap 1\ncast "a" to bf16\nunmatched keep\n'

    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` finds without Ray
    with pytest.raises(ExecutionError, match=r"pip install 'weightmap\[ray\]'"):
        weightmap.remap(tmp_path, tmp_path / "out", mapping=text, executor="ray")
    with pytest.raises(ValueError, match="unknown executor"):
        weightmap.remap(tmp_path, tmp_path / "out", mapping=text, executor="dask")  # type: ignore[arg-type]


def _closed_port() -> int:
    """A local port nothing listens on (bound and released at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_address_where_nothing_answers_fails_at_once(
    tmp_path: Path,
    example: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A mistyped address or a head node not started: one line now, not Ray's minutes of
    retries; nothing written. `auto` and `local` are left to Ray."""
    port = _closed_port()

    def no_init(**_kwargs: Any) -> None:
        raise AssertionError("ray.init was called for an address where nothing answers")

    # As for a driver that has not joined a cluster yet (this module's tests have one).
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_init)
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(ExecutionError, match=rf"nothing answers at 127\.0\.0\.1:{port}"):
            weightmap.remap(example, tmp_path / "out", preset="eagle3-sglang", executor="ray",
                            ray_address=address)  # fmt: skip
    args = ["convert", str(example), str(tmp_path / "cli"), "--preset", "eagle3-sglang"]
    assert cli.main([*args, "--ray-address", f"127.0.0.1:{port}"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ray start --head" in err[0], err
    assert not (tmp_path / "out").exists() and not (tmp_path / "cli").exists()
    assert leftovers(tmp_path) == []

    # The address Ray takes from the environment where none is given, the same way.
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(ExecutionError, match=r"\(RAY_ADDRESS\): nothing answers at 127"):
        weightmap.remap(example, tmp_path / "out", preset="eagle3-sglang", executor="ray")
    monkeypatch.delenv("RAY_ADDRESS")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []

    def no_socket(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("checked an address that is not a host and a port")

    monkeypatch.setattr(socket, "create_connection", no_socket)
    for address in ("auto", "local", "ray://head", "[::1]"):
        cluster_module._answers(address)


@pytest.fixture(params=cowfs.KINDS)
def cow(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A loop-mounted copy-on-write filesystem (as in test_cow), or a skip saying why not."""
    yield from cow_mount(str(request.param), tmp_path_factory)


def test_tasks_clone_on_copy_on_write_filesystems(cow: Path) -> None:
    """Tasks clone the unchanged bytes into the shards themselves: as much is shared as by the
    local executor, in extents the filesystem marks shared, and the bytes are the same."""
    root = cow / "in"
    root.mkdir()
    gen = torch.Generator().manual_seed(3)
    save_file(
        {
            f"w{i}": torch.randn(300 + 37 * i, 200, generator=gen).to(torch.bfloat16)
            for i in range(6)
        },
        root / "model.safetensors",
    )
    plan = weightmap.compile(root, mapping='weightmap 1\ncast "w2" to f32\nunmatched keep\n')
    local, remote = local_and_ray(root, plan, task_cost=64 * 1024, chunk_bytes=4096)
    assert folder_bytes(root / "ray") == folder_bytes(root / "local")
    assert remote == local and remote.bytes_cloned > 0
    shard = root / "ray" / "model.safetensors"
    assert cowfs.shared_bytes(shard) >= remote.bytes_cloned


def test_progress_without_its_actor(tmp_path: Path) -> None:
    """The progress actor gone (killed, its node lost): the conversion goes on, the bar is
    fed from the tasks' reports, and the next conversion starts another actor."""
    plan = _checkpoint(tmp_path)
    ray.kill(cluster_module._progress_actor(ray))
    seen: list[int] = []
    local, remote = local_and_ray(tmp_path, plan, task_cost=8192, progress=seen.append)
    assert remote == local
    assert sum(seen) == sum(s.nbytes for s in plan.output_specs())
    seen.clear()
    with Checkpoint.open(tmp_path) as ckpt:
        execute_on_ray(plan, ckpt, tmp_path / "again", task_cost=8192, progress=seen.append)
    assert sum(seen) == sum(s.nbytes for s in plan.output_specs())


@pytest.mark.parametrize(("desc_act", "with_g_idx"), [(True, True), (False, False)])
def test_gptq_dequant_on_ray_gives_the_local_bytes(
    tmp_path: Path, desc_act: bool, with_g_idx: bool
) -> None:
    """The quantized formats' nodes (unpack, gather, sub, mul, transpose) run in Ray tasks as
    locally: a GPTQ checkpoint (act-order g_idx, or none: groups in order) dequantized in row
    ranges that cut packed words."""
    from test_quant_formats import _expect_gptq, _gptq_checkpoint

    tensors = _gptq_checkpoint(tmp_path / "src", desc_act=desc_act, with_g_idx=with_g_idx)
    plan = weightmap.compile(tmp_path / "src", preset="gptq-dequant")
    local, remote = local_and_ray(tmp_path / "src", plan, chunk_bytes=300, task_cost=64)
    assert folder_bytes(tmp_path / "src" / "ray") == folder_bytes(tmp_path / "src" / "local")
    assert remote == local
    with Checkpoint.open(tmp_path / "src" / "ray") as out:
        for name, t in _expect_gptq(tensors, 4).items():
            assert torch.equal(out.view(name), t), name


def test_awq_dequant_on_ray_gives_the_local_bytes(tmp_path: Path) -> None:
    """AWQ's interleaved nibble order unpacked in Ray tasks, row ranges cutting groups and
    packed words: AutoAWQ's values, the local executor's bytes."""
    from test_quant_formats import _awq_checkpoint, dequantize_gemm

    tensors = _awq_checkpoint(tmp_path / "src", 16)
    plan = weightmap.compile(tmp_path / "src", preset="awq-dequant")
    local, remote = local_and_ray(tmp_path / "src", plan, chunk_bytes=300, task_cost=64)
    assert folder_bytes(tmp_path / "src" / "ray") == folder_bytes(tmp_path / "src" / "local")
    assert remote == local
    with Checkpoint.open(tmp_path / "src" / "ray") as out:
        for base in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"):
            ref = dequantize_gemm(tensors[f"{base}.qweight"], tensors[f"{base}.qzeros"],
                                  tensors[f"{base}.scales"], 4, 16).T  # fmt: skip
            assert torch.equal(out.view(f"{base}.weight"), ref), base


@pytest.mark.parametrize(("version", "ranks"), [("2", 4), ("3", 2)])
def test_meta_ranks_on_ray(tmp_path: Path, version: str, ranks: int) -> None:
    """Meta's rank files (PyTorch pickles, read by each task under their rank's names), Llama 2
    (embeddings joined along dim 1) and 3: the cluster writes the local executor's bytes."""
    from several import VOCAB, meta_ranks

    folder, _ = meta_ranks(tmp_path / "meta", version, ranks)
    params = {"version": version} | ({"vocab_size": VOCAB} if version == "2" else {})
    how: dict[str, Any] = {"preset": "llama-meta-ranks-to-hf", "params": params}
    weightmap.remap(folder, tmp_path / "m-local", progress=False, **how)
    weightmap.remap(folder, tmp_path / "m-ray", executor="ray", workers=2, chunk_bytes=4096, **how)
    assert folder_bytes(tmp_path / "m-ray") == folder_bytes(tmp_path / "m-local")


def test_replicas_that_differ_stop_the_run_on_ray(tmp_path: Path) -> None:
    """A norm that differs between ranks stops the cluster's run as the local one, naming
    the rank, and leaves nothing."""
    from several import meta_ranks

    folder, per = meta_ranks(tmp_path / "meta", "3", 2)
    per[1]["layers.1.ffn_norm.weight"][3] += 1
    torch.save(per[1], folder / "consolidated.01.pth")
    how: dict[str, Any] = {"preset": "llama-meta-ranks-to-hf", "params": {"version": "3"}}
    message = "ranks:1:layers.1.ffn_norm.weight holds other bytes than ranks:0:layers.1.ffn_norm"
    with pytest.raises(ExecutionError, match=message):
        weightmap.remap(folder, tmp_path / "out", executor="ray", workers=2, **how)
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


@pytest.mark.parametrize(
    ("dtype", "extra", "params"),
    [(torch.bfloat16, {}, {}), (torch.float16, {"use_rslora": True}, {"autocast": False})],
)
def test_lora_merge_on_ray(
    tmp_path: Path, dtype: torch.dtype, extra: dict[str, Any], params: dict[str, Any]
) -> None:
    """A LoRA merge (matmul of the adapter's factors, added to the base) in Ray tasks: the
    local executor's bytes, both roundings."""
    from several import lora_pair

    base, adapter = lora_pair(tmp_path / "lora", base_dtype=dtype, adapter_dtype=dtype, extra=extra)
    lora: dict[str, Any] = {
        "preset": "lora-merge",
        "inputs": {"adapter": adapter},
        "params": params,
    }
    weightmap.remap(base, tmp_path / "l-local", progress=False, **lora)
    weightmap.remap(
        base, tmp_path / "l-ray", executor="ray", workers=2, chunk_bytes=4096, verify=True, **lora
    )
    assert folder_bytes(tmp_path / "l-ray") == folder_bytes(tmp_path / "l-local")


@pytest.mark.parametrize(("version", "ranks"), [("2", 4), ("3", 2)])
def test_several_outputs_on_ray(tmp_path: Path, version: str, ranks: int) -> None:
    """Hugging Face Llama back into Meta's rank files: each task writes into the member file
    its piece belongs to, and the cluster writes the local executor's bytes."""
    from test_several_outputs import _hf

    hf, _, params = _hf(tmp_path, version, ranks)
    how: dict[str, Any] = {"preset": "llama-hf-to-meta-ranks", "params": params}
    weightmap.remap(hf, tmp_path / "local", progress=False, **how)
    weightmap.remap(
        hf, tmp_path / "ray", executor="ray", workers=2, chunk_bytes=4096, verify=True, **how
    )
    assert folder_bytes(tmp_path / "ray") == folder_bytes(tmp_path / "local")
    assert sorted(p.name for p in (tmp_path / "ray").glob("*.safetensors")) == [
        f"consolidated.{rank:02d}.safetensors" for rank in range(ranks)
    ]
