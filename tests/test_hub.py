"""Hub repository ids as inputs, offline: a cache folder in huggingface_hub's exact layout
(``models--org--name/{refs,snapshots/<commit>,blobs}``, files linked into blobs/); and, with
huggingface_hub's API replaced by a fake, that only the files the plan needs are fetched."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import weightmap
from weightmap.errors import CheckpointError

hub = pytest.importorskip("huggingface_hub")
pytest.importorskip("huggingface_hub.constants")
pytest.importorskip("huggingface_hub.errors")

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SIDE = {"README.md": "# tiny\n", "tokenizer.json": '{"v": 1}\n', "tok/vocab.txt": "a\nb\n"}


def cache_repo(
    cache: Path, src: Path, repo_id: str = "org/tiny", skip: tuple[str, ...] = ()
) -> Path:
    """Put ``src``'s files into ``cache`` as huggingface_hub stores a downloaded revision."""
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    snap = storage / "snapshots" / COMMIT
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(COMMIT)
    (storage / "refs" / "v1").write_text(COMMIT)
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        name = path.relative_to(src).as_posix()
        if name in skip:
            continue
        data = path.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snap


def _model(tmp_path: Path, example: Path) -> Path:
    src = tmp_path / "model"
    shutil.copytree(example, src)
    for name, text in SIDE.items():
        (src / name).parent.mkdir(exist_ok=True)
        (src / name).write_text(text)
    return src


def _run(*args: str, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", **env}
    return subprocess.run(
        [sys.executable, "-m", "weightmap", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=environ,
    )


@pytest.mark.parametrize("spec", ["org/tiny", "org/tiny@v1", f"org/tiny@{COMMIT}"])
def test_convert_a_cached_repo_offline(tmp_path: Path, example: Path, spec: str) -> None:
    src = _model(tmp_path, example)
    cache_repo(tmp_path / "cache", src)
    out = tmp_path / "out"
    r = _run("convert", spec, str(out), "--preset", "eagle3-sglang", cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr
    assert (out / "model.safetensors").stat().st_size == (src / "model.safetensors").stat().st_size
    for name, text in SIDE.items():
        assert (out / name).read_text() == text and not (out / name).is_symlink()


def test_remap_a_repo_id(tmp_path: Path, example: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache_repo(tmp_path / "cache", _model(tmp_path, example))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = weightmap.remap("org/tiny", tmp_path / "out", preset="eagle3-sglang", verify=True)
    assert sorted(f.name for f in result.plan.files) == sorted(SIDE)
    plan = weightmap.compile("org/tiny", preset="eagle3-sglang")
    assert len(plan.outputs) == 16


def test_offline_and_not_cached(tmp_path: Path, example: Path) -> None:
    r = _run("convert", "org/absent", str(tmp_path / "o"), "--preset", "x", cache=tmp_path)
    assert r.returncode == 2  # the preset is checked first
    r = _run(
        "convert", "org/absent", str(tmp_path / "o"), "--preset", "eagle3-sglang", cache=tmp_path
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "org/absent: this repository is not in the local Hugging Face cache" in r.stderr
    assert "HF_HUB_OFFLINE=1" in r.stderr and "[hub-offline]" in r.stderr
    assert "did you mean" not in r.stderr  # (nothing cached is close)


def test_a_mistyped_repo_id_gets_the_cached_one_it_was_meant_as(
    tmp_path: Path, example: Path
) -> None:
    cache_repo(tmp_path / "cache", _model(tmp_path, example), repo_id="myorg/tiny-llama")
    r = _run("inspect", "myorg/tiny-lama", cache=tmp_path / "cache")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "myorg/tiny-lama: this repository is not in the local" in r.stderr
    assert "did you mean myorg/tiny-llama? (that one is cached)" in r.stderr


def test_a_shard_missing_from_the_cache(tmp_path: Path, example: Path) -> None:
    src = _model(tmp_path, example)
    weightmap.remap(example, src / "sharded", preset="eagle3-sglang", max_shard_size="50KB")
    shard = sorted((src / "sharded").glob("model-00002-of-*.safetensors"))[0].name
    cache_repo(tmp_path / "cache", src / "sharded", skip=(shard,))
    r = _run("inspect", "org/tiny", cache=tmp_path / "cache")
    assert r.returncode == 1, r.stdout
    assert f"{shard} is not in the local Hugging Face cache" in r.stderr


def test_inspect_and_plan_take_repo_ids(tmp_path: Path, example: Path) -> None:
    cache_repo(tmp_path / "cache", _model(tmp_path, example))
    r = _run("plan", "org/tiny", "--preset", "eagle3-sglang", cache=tmp_path / "cache")
    assert r.returncode == 0 and "3 side file(s)" in r.stdout, r.stderr


def test_without_the_extra(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['huggingface_hub'] = None\n"
        "from weightmap.cli import main\n"
        "sys.exit(main(['inspect', 'org/name']))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 1
    assert r.stderr == (
        "weightmap: error: org/name: is not a local folder or file; read as a Hugging Face "
        "repository id it needs huggingface_hub: pip install 'weightmap[hub]' (or give a local "
        "path) [hub-missing]\n"
    )


class _FakeFile:
    def __init__(self, path: str, size: int) -> None:
        self.path, self.size = path, size


def _fake_hub(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, remote: Path, tree: bool = False
) -> list[list[str]]:
    """A Hub holding ``remote`` at COMMIT on main, and a download that lays the cache out as
    huggingface_hub 2.x does: the snapshot and blobs, no ``refs/`` entry for a revision that
    is the commit itself, and (``tree``) the revision's whole file list under trees/."""
    files = {p.relative_to(remote).as_posix(): p for p in remote.rglob("*") if p.is_file()}
    asked: list[list[str]] = []

    class FakeApi:
        def repo_info(self, repo_id: str, revision: str) -> Any:
            return type("Info", (), {"sha": COMMIT})()

        def list_repo_tree(self, repo_id: str, recursive: bool, revision: str) -> list[_FakeFile]:
            return [_FakeFile(n, p.stat().st_size) for n, p in files.items()]

    def fake_download(repo_id: str, revision: str, allow_patterns: list[str], **kw: Any) -> str:
        asked.append(sorted(allow_patterns))
        storage = tmp_path / "cache" / f"models--{repo_id.replace('/', '--')}"
        snap = storage / "snapshots" / COMMIT
        for n, p in files.items():
            if n in allow_patterns:
                (snap / n).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(p, snap / n)
        if revision != COMMIT:
            (storage / "refs").mkdir(parents=True, exist_ok=True)
            (storage / "refs" / revision).write_text(COMMIT)
        if tree:
            (storage / "trees").mkdir(parents=True, exist_ok=True)
            listing = {n: {"size": p.stat().st_size, "blob_id": "0" * 40} for n, p in files.items()}
            (storage / "trees" / f"{COMMIT}.json").write_text(
                json.dumps({"format_version": 1, "files": listing})
            )
        return str(snap)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hub, "HfApi", FakeApi)
    monkeypatch.setattr(hub, "snapshot_download", fake_download)
    return asked


def test_only_the_files_the_plan_needs_are_downloaded(
    tmp_path: Path, example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote = _model(tmp_path, example)
    (remote / "pytorch_model.bin").write_bytes(b"the same weights, pickled")
    (remote / ".gitattributes").write_text("*.bin filter=lfs\n")
    asked = _fake_hub(monkeypatch, tmp_path, remote)
    mapping = 'weightmap 1\nunmatched keep\nfiles {\n    drop "README.md"\n}\n'
    result = weightmap.remap("org/tiny", tmp_path / "out", mapping=mapping, progress=False)
    # The weights and config first, then the side files the plan keeps; never the .bin copy
    # of the weights, the dropped README or the hidden files. One file a call: a stop asked
    # for is honoured between files.
    assert all(len(call) == 1 for call in asked)
    got = [call[0] for call in asked]
    assert sorted(got[:2]) == ["config.json", "model.safetensors"]
    assert sorted(got[2:]) == ["tok/vocab.txt", "tokenizer.json"]
    assert sorted(f.name for f in result.plan.files) == ["tok/vocab.txt", "tokenizer.json"]
    assert (tmp_path / "out" / "tok" / "vocab.txt").read_text() == "a\nb\n"


def test_hub_errors_are_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    class Missing:
        def repo_info(self, repo_id: str, revision: str) -> Any:
            raise hub.errors.RepositoryNotFoundError("404", response=_Response())

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "HfApi", Missing)
    with pytest.raises(CheckpointError) as info:
        weightmap.compile("org/nothing", preset="eagle3-sglang")
    assert info.value.rule == "hub-not-found"
    assert "is no repository on the Hub" in str(info.value)


class _Response:
    status_code = 404
    headers: dict[str, str] = {}  # noqa: RUF012
    url = "https://huggingface.co"
    request = None

    def json(self) -> dict[str, str]:
        return json.loads("{}")


def test_inplace_never_rewrites_the_cache(
    tmp_path: Path, example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repository's files are links into the cache's blobs, each named by its content and
    shared by every revision that holds it: an in-place rename is refused, by id or by the
    snapshot folder's path, before anything is written."""
    snap = cache_repo(tmp_path / "cache", _model(tmp_path, example))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    blobs = snap.parent.parent / "blobs"
    before = {p.name: p.read_bytes() for p in blobs.iterdir()}
    for spec in ("org/tiny", str(snap)):
        with pytest.raises(CheckpointError) as info:
            weightmap.remap(spec, preset="eagle3-sglang", inplace=True)
        assert info.value.rule == "inplace-link" and "convert into a new folder" in str(info.value)
    assert {p.name: p.read_bytes() for p in blobs.iterdir()} == before
    assert all(p.is_symlink() for p in snap.iterdir() if p.is_file())


def test_verify_takes_the_repo_id_it_converted(
    tmp_path: Path, example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_repo(tmp_path / "cache", _model(tmp_path, example))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = weightmap.remap("org/tiny", tmp_path / "out", preset="eagle3-sglang")
    assert weightmap.verify(tmp_path / "out", result.plan, source="org/tiny") == []
    (tmp_path / "out" / "tok" / "vocab.txt").write_text("a\nc\n")
    assert weightmap.verify(tmp_path / "out", result.plan, source="org/tiny@v1") == [
        "side file 'tok/vocab.txt' differs from 'tok/vocab.txt' in the input"
    ]


@pytest.mark.parametrize(
    ("spec", "ok"),
    [
        ("org/name", True),
        ("org/name@main", True),
        ("org/name@refs/pr/1", True),
        ("org/name@v1.0", True),
        ("org/name@/etc/passwd", False),  # an absolute path: refs/ joined with it is that path
        ("org/name@../../x", False),
        ("org/name@a//b", False),
        ("org/name@a/", False),
    ],
)
def test_a_revision_is_never_a_path_out_of_refs(spec: str, ok: bool) -> None:
    """The revision names a file under the cache's refs/ folder (offline): one that would lead
    out of it (and read, say, /dev/zero) is no repository id."""
    from weightmap.inputs.hub import HubRepo, looks_like_repo_id

    assert looks_like_repo_id(spec) is ok
    if not ok:
        with pytest.raises(ValueError, match="not a repository id"):
            HubRepo(spec)


def test_a_repo_downloaded_by_branch_is_found_offline_by_branch(
    tmp_path: Path, example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The download asks for the resolved commit, for which huggingface_hub writes no
    # refs/main: offline, `org/tiny` was then "not in the local Hugging Face cache".
    _fake_hub(monkeypatch, tmp_path, _model(tmp_path, example))
    weightmap.remap("org/tiny", tmp_path / "online", preset="eagle3-sglang", progress=False)
    ref = tmp_path / "cache" / "models--org--tiny" / "refs" / "main"
    assert ref.read_text() == COMMIT
    r = _run("convert", "org/tiny", str(tmp_path / "offline"), "--preset", "eagle3-sglang",
             cache=tmp_path / "cache")  # fmt: skip
    assert r.returncode == 0, r.stderr
    online, offline = (tmp_path / d / "model.safetensors" for d in ("online", "offline"))
    assert online.read_bytes() == offline.read_bytes()


def test_offline_a_side_file_never_downloaded_is_named_not_left_out(
    tmp_path: Path, example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_hub(monkeypatch, tmp_path, _model(tmp_path, example), tree=True)
    weightmap.remap(
        "org/tiny", tmp_path / "bare", preset="eagle3-sglang", side_files=False, progress=False
    )
    r = _run("convert", "org/tiny", str(tmp_path / "o"), "--preset", "eagle3-sglang",
             cache=tmp_path / "cache")  # fmt: skip
    assert r.returncode == 1 and not (tmp_path / "o").exists()
    assert "README.md, tok/vocab.txt, tokenizer.json are not in the local" in r.stderr
    assert "--no-side-files" in r.stderr
    r = _run("convert", "org/tiny", str(tmp_path / "o"), "--preset", "eagle3-sglang",
             "--no-side-files", cache=tmp_path / "cache")  # fmt: skip
    assert r.returncode == 0, r.stderr


def test_a_repo_with_both_forms_is_read_as_a_local_copy_is(
    tmp_path: Path, example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # model.safetensors beside a PyTorch index: the folder reads model.safetensors, and so
    # must the repository (the .bin shards were downloaded and unpickled instead).
    remote = _model(tmp_path, example)
    (remote / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {"fc.weight": "pytorch_model-00001-of-00001.bin"}})
    )
    (remote / "pytorch_model-00001-of-00001.bin").write_bytes(b"pickled weights")
    asked = _fake_hub(monkeypatch, tmp_path, remote)
    plan = weightmap.compile("org/tiny", preset="eagle3-sglang")
    assert sorted(name for call in asked for name in call) == ["config.json", "model.safetensors"]
    assert plan.outputs == weightmap.compile(remote, preset="eagle3-sglang").outputs


def test_a_hub_index_without_a_weight_map_object_is_named(
    tmp_path: Path, example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote = _model(tmp_path, example)
    (remote / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a"]}))
    _fake_hub(monkeypatch, tmp_path, remote)
    with pytest.raises(CheckpointError, match=r'"weight_map" object') as info:
        weightmap.compile("org/tiny", preset="eagle3-sglang")
    assert info.value.rule == "index"  # type: ignore[attr-defined]


# -- issue 33: a Hub cache follows the local folder's rules, and is read bounded ---------------


def _limited() -> None:
    """A child that reads a device without end runs out of memory quickly, not the machine."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))


@pytest.mark.parametrize("special", ["fifo", "/dev/zero"])
def test_a_ref_that_is_a_fifo_or_device_is_refused_at_once(
    tmp_path: Path, example: Path, special: str
) -> None:
    cache_repo(tmp_path / "cache", _model(tmp_path, example))
    ref = tmp_path / "cache" / "models--org--tiny" / "refs" / "main"
    ref.unlink()
    if special == "fifo":
        os.mkfifo(ref)
    else:
        ref.symlink_to(special)
    r = subprocess.run(
        [sys.executable, "-m", "weightmap", "inspect", "org/tiny"],
        capture_output=True,
        text=True,
        timeout=60,  # a FIFO was waited on for ever
        env={**os.environ, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"},
        preexec_fn=_limited,
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "refs/main" in r.stderr and "Traceback" not in r.stderr
    assert ("FIFO" in r.stderr) if special == "fifo" else ("/dev/zero" in r.stderr)


def test_a_snapshot_folder_linked_out_of_the_cache_is_refused(
    tmp_path: Path, example: Path
) -> None:
    snap = cache_repo(tmp_path / "cache", _model(tmp_path, example))
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(snap, elsewhere, symlinks=False)
    shutil.rmtree(snap)
    snap.symlink_to(elsewhere)
    r = _run("convert", "org/tiny", str(tmp_path / "out"), "--preset", "eagle3-sglang",
             cache=tmp_path / "cache")  # fmt: skip
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "outside the cache" in r.stderr and "[hub-snapshot-link]" in r.stderr
    assert not (tmp_path / "out").exists()


def test_cached_entries_linking_out_of_the_cache_are_skipped_at_plan_time(
    tmp_path: Path, example: Path
) -> None:
    snap = cache_repo(tmp_path / "cache", _model(tmp_path, example))
    secret = tmp_path / "secret.txt"
    secret.write_text("token")
    (snap / "notes.txt").symlink_to(secret)
    r = _run("plan", "org/tiny", "--preset", "eagle3-sglang", cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr
    shown = r.stdout + r.stderr
    assert "'notes.txt' is not carried: it is a link that leaves the cache" in shown
    assert "3 side file(s)" in r.stdout
    out = tmp_path / "out"
    r = _run("convert", "org/tiny", str(out), "--preset", "eagle3-sglang",
             cache=tmp_path / "cache")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert not (out / "notes.txt").exists() and (out / "tokenizer.json").exists()


def test_fifo_blobs_are_named(tmp_path: Path, example: Path) -> None:
    snap = cache_repo(tmp_path / "cache", _model(tmp_path, example))
    blobs = tmp_path / "cache" / "models--org--tiny" / "blobs"
    os.mkfifo(blobs / "fifo")
    (snap / "chat_template.jinja").symlink_to("../../blobs/fifo")
    r = _run("plan", "org/tiny", "--preset", "eagle3-sglang", cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr
    assert "'chat_template.jinja' is not carried: it is a FIFO" in r.stdout + r.stderr
    # The weights a FIFO: named as such, not "holds no checkpoint".
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to("../../blobs/fifo")
    r = _run("inspect", "org/tiny", cache=tmp_path / "cache")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "model.safetensors" in r.stderr and "FIFO" in r.stderr
    assert "holds no checkpoint" not in r.stderr


def test_a_snapshot_linked_out_of_the_cache_is_refused_before_a_download(
    tmp_path: Path, example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = _fake_hub(monkeypatch, tmp_path, _model(tmp_path, example))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    snapshots = tmp_path / "cache" / "models--org--tiny" / "snapshots"
    snapshots.mkdir(parents=True)
    (snapshots / COMMIT).symlink_to(elsewhere)
    with pytest.raises(CheckpointError) as info:
        weightmap.remap("org/tiny", tmp_path / "out", preset="eagle3-sglang", progress=False)
    assert info.value.rule == "hub-snapshot-link"
    assert asked == [] and list(elsewhere.iterdir()) == []


def test_a_cancel_stops_the_download_between_files(
    tmp_path: Path, example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop asked for during a download is honoured before the next file: huggingface_hub's
    download of several files finishes its whole batch before returning."""
    import threading

    remote = _model(tmp_path, example)
    asked = _fake_hub(monkeypatch, tmp_path, remote)
    stop = threading.Event()
    real = hub.snapshot_download

    def download_then_stop(*args: Any, **kw: Any) -> str:
        stop.set()  # (as a Ctrl-C or a caller's cancel would, while the first file comes in)
        return str(real(*args, **kw))

    monkeypatch.setattr(hub, "snapshot_download", download_then_stop)
    with pytest.raises(weightmap.Cancelled, match="the download was cancelled"):
        weightmap.remap("org/tiny", tmp_path / "out", preset="eagle3-sglang", cancel=stop)
    assert len(asked) == 1  # the first file, not the second
    assert not (tmp_path / "out").exists()


def test_a_cancel_stops_a_download_in_the_middle_of_a_file(
    tmp_path: Path, example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop asked while a file comes in returns at once, not when the file has come in (a
    shard of several GB): the file is left to the download's own thread."""
    import threading
    import time

    remote = _model(tmp_path, example)
    _fake_hub(monkeypatch, tmp_path, remote)
    stop, release = threading.Event(), threading.Event()
    real = hub.snapshot_download

    def slow_download(*args: Any, **kw: Any) -> str:
        stop.set()  # (the caller asks to stop as the file starts coming in)
        release.wait(60)  # (the rest of a large file)
        return str(real(*args, **kw))

    monkeypatch.setattr(hub, "snapshot_download", slow_download)
    started = time.monotonic()
    try:
        with pytest.raises(weightmap.Cancelled, match="the download was cancelled"):
            weightmap.remap("org/tiny", tmp_path / "out", preset="eagle3-sglang", cancel=stop)
        assert time.monotonic() - started < 30  # (the file would have taken 60 s)
    finally:
        release.set()
    assert not (tmp_path / "out").exists()


def test_ctrl_c_during_a_download_is_raised_at_once_and_never_inside_its_pool(
    tmp_path: Path, example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python's own SIGINT handler is held back while the file comes in (huggingface_hub's
    pool, whose locks the waiting thread takes, runs beside it), and its KeyboardInterrupt
    raised at once, not when the file has come in."""
    import signal
    import threading
    import time

    remote = _model(tmp_path, example)
    _fake_hub(monkeypatch, tmp_path, remote)
    release = threading.Event()
    handlers: list[Any] = []
    real = hub.snapshot_download

    def slow_download(*args: Any, **kw: Any) -> str:
        handlers.append(signal.getsignal(signal.SIGINT))
        os.kill(os.getpid(), signal.SIGINT)  # (Ctrl-C as the file starts coming in)
        release.wait(60)
        return str(real(*args, **kw))

    monkeypatch.setattr(hub, "snapshot_download", slow_download)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            weightmap.remap("org/tiny", tmp_path / "out", preset="eagle3-sglang", progress=False)
        assert time.monotonic() - started < 30  # (the file would have taken 60 s)
        assert handlers and handlers[0] is not signal.default_int_handler  # (held back)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # (put back)
    finally:
        release.set()
        signal.signal(signal.SIGINT, previous)
    assert not (tmp_path / "out").exists()


def test_a_failed_download_in_its_thread_is_the_error_raised(
    tmp_path: Path, example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote = _model(tmp_path, example)
    _fake_hub(monkeypatch, tmp_path, remote)

    def broken(*args: Any, **kw: Any) -> str:
        raise hub.errors.RepositoryNotFoundError("404", response=_Response())

    monkeypatch.setattr(hub, "snapshot_download", broken)
    with pytest.raises(CheckpointError) as info:
        weightmap.remap("org/tiny", tmp_path / "out", preset="eagle3-sglang", progress=False)
    assert info.value.rule == "hub-not-found"  # (translated as a failure in this thread is)


# ---- families of rank files on the Hub ------------------------------------------------------


def _tensors(folder: Path) -> dict[str, bytes]:
    from safetensors.torch import load_file

    out: dict[str, bytes] = {}
    for path in sorted(folder.glob("*.safetensors")):
        for name, t in load_file(path).items():
            out[name] = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return out


@pytest.fixture
def meta(tmp_path: Path) -> tuple[Path, Path]:
    """Meta's Llama 3 rank files and params.json, and the output of converting the folder."""
    from several import meta_ranks

    folder, _ = meta_ranks(tmp_path, "3", 2)
    params = {"version": "3"}
    weightmap.remap(folder, tmp_path / "local", preset="llama-meta-ranks-to-hf", params=params)
    return folder, tmp_path / "local"


def test_a_family_of_rank_files_read_from_a_repo_id(
    tmp_path: Path, meta: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The main input a Hub id whose top holds Meta's rank files: the members and params.json
    are fetched (and the side files the plan keeps), one file a call; the output is the local
    folder's, from Python and (offline, from the cache so filled) from the CLI."""
    folder, local = meta
    (folder / "notes").mkdir()
    (folder / "notes" / "consolidated.00.pth").write_bytes(b"not a member: not at the top")
    asked = _fake_hub(monkeypatch, tmp_path, folder)
    weightmap.remap(
        "org/llama", tmp_path / "hub", preset="llama-meta-ranks-to-hf", params={"version": "3"}
    )
    got = [call[0] for call in asked]
    assert sorted(got[:3]) == ["consolidated.00.pth", "consolidated.01.pth", "params.json"]
    assert got[3:] == ["tokenizer.model"]  # (a side file; notes/ holds weights, not carried)
    assert _tensors(tmp_path / "hub") == _tensors(local)
    assert (tmp_path / "hub" / "config.json").read_text() == (local / "config.json").read_text()
    r = _run(
        "convert", "org/llama", str(tmp_path / "cli"), "--preset", "llama-meta-ranks-to-hf",
        "--set", "version=3", cache=tmp_path / "cache",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert _tensors(tmp_path / "cli") == _tensors(local)


_JOIN = """weightmap 1
input ranks files "consolidated.{rank}.pth"
merge "ranks:{r:int}:output.weight" dim 0 -> "meta.output.weight"
drop "ranks:**"
unmatched keep
"""


def test_a_family_bound_to_a_repo_id(
    tmp_path: Path, example: Path, meta: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``inputs={"ranks": "org/llama"}``: the family's members come from the repository (and
    nothing else of it), the main input's tensors from a local folder."""
    folder, local = meta
    asked = _fake_hub(monkeypatch, tmp_path, folder)
    out = tmp_path / "hub"
    weightmap.remap(example, out, mapping=_JOIN, inputs={"ranks": "org/llama"}, progress=False)
    assert sorted(call[0] for call in asked) == ["consolidated.00.pth", "consolidated.01.pth"]
    got = _tensors(out)
    assert got["meta.output.weight"] == _tensors(local)["lm_head.weight"]  # (write_model's join)
    assert set(got) == {"meta.output.weight", *_tensors(example)}


_FOLDERS = """weightmap 1
input ranks files "rank{rank}"
merge "ranks:{r:int}:w" dim 0 -> "w"
merge "ranks:{r:int}:b" same -> "b"
"""


def test_a_family_of_rank_folders_read_from_a_repo_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repository whose top holds a checkpoint folder per rank (one a single file, one an
    index and its shards): of each folder, what opening it as a checkpoint reads is fetched,
    and the side files the plan keeps; the output is the local folder's."""
    from safetensors.torch import save_file

    remote = tmp_path / "remote"
    for rank in (0, 1):
        (remote / f"rank{rank}").mkdir(parents=True)
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    b = torch.ones(6, dtype=torch.bfloat16)
    save_file({"w": w[:2].clone(), "b": b}, remote / "rank0" / "model.safetensors")
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    save_file({"w": w[2:].clone()}, remote / "rank1" / shards[0])
    save_file({"b": b.clone()}, remote / "rank1" / shards[1])
    index = {"metadata": {}, "weight_map": {"w": shards[0], "b": shards[1]}}
    (remote / "rank1" / "model.safetensors.index.json").write_text(json.dumps(index))
    (remote / "rank1" / "notes.txt").write_text("not part of the checkpoint")
    weightmap.remap(remote, tmp_path / "local", mapping=_FOLDERS, progress=False)
    asked = _fake_hub(monkeypatch, tmp_path, remote)
    weightmap.remap("org/ranks", tmp_path / "hub", mapping=_FOLDERS, progress=False)
    got = {call[0] for call in asked}
    # Of the folders, their checkpoints; and notes.txt, a side file, as from the local folder.
    weights = ["rank0/model.safetensors", "rank1/model.safetensors.index.json"]
    assert got == {*weights, *(f"rank1/{s}" for s in shards), "rank1/notes.txt"}
    files = [
        sorted(p.relative_to(o) for p in o.rglob("*"))
        for o in (tmp_path / "hub", tmp_path / "local")
    ]
    assert files[0] == files[1]
    assert _tensors(tmp_path / "hub") == _tensors(tmp_path / "local")
    assert _tensors(tmp_path / "hub")["w"] == w.numpy().tobytes()


def test_a_repo_without_members_or_with_member_folders_is_named(
    tmp_path: Path, example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked on the repository's listing, before a byte is fetched: no member, a rank
    missing, two members of one rank, a member folder that holds no checkpoint."""
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "params.json").write_text("{}")
    preset = {"preset": "llama-meta-ranks-to-hf", "params": {"version": "3"}}
    cases = [
        ([], r"no file or folder here matches input 'ranks'"),
        (["consolidated.00.pth", "consolidated.02.pth"], r"ranks 0, 2: rank 1 is missing"),
        (["consolidated.00.pth", "consolidated.0.pth"], r"are both rank 0 of input 'ranks'"),
        (
            ["consolidated.00.pth/x"],
            r"no checkpoint weightmap reads in its folder 'consolidated.00.pth'",
        ),
    ]
    for names, message in cases:
        for old in remote.glob("consolidated.*"):
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        for name in names:
            (remote / name).parent.mkdir(exist_ok=True)
            (remote / name).write_bytes(b"weights")
        asked = _fake_hub(monkeypatch, tmp_path, remote)
        with pytest.raises(CheckpointError, match=message) as e:
            weightmap.remap("org/llama", tmp_path / "o", **preset)  # type: ignore[arg-type]
        assert "org/llama" in str(e.value) and asked == [], (names, asked)
        assert not (tmp_path / "o").exists()


def test_the_family_config_is_fetched(
    tmp_path: Path, meta: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A family that reads a config of its own (``config from``) gets it from the repository
    too, and expressions see it."""
    folder, _ = meta
    (folder / "ranks.json").write_text('{"n": 2}')
    asked = _fake_hub(monkeypatch, tmp_path, folder)
    mapping = """weightmap 1
input ranks files "consolidated.{rank}.pth" config from "ranks.json"
require ranks.config.n == ranks.count else "ranks.json disagrees"
merge "ranks:{r:int}:output.weight" dim 0 -> "output.weight"
drop "ranks:**"
"""
    plan = weightmap.compile("org/llama", mapping=mapping)
    assert [o.name for o in plan.outputs] == ["output.weight"]
    assert "ranks.json" in [call[0] for call in asked]


def _remember(cache: Path, revision: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    """The code a download of a branch or tag runs after it: the ref of ``revision`` written
    for a snapshot of the cache (the download itself left out). Returns the repo folder and
    the commit."""
    from weightmap.inputs.hub import HubRepo

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--org--name"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    h = HubRepo(f"org/name@{revision}")
    h.commit = commit  # (what the Hub said the revision names)
    h._remember_revision(snapshot)
    return repo, commit


def test_a_ref_is_written_in_refs_under_its_revision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo, commit = _remember(tmp_path / "cache", "release/v1", monkeypatch)
    assert (repo / "refs" / "release" / "v1").read_text() == commit
    assert sorted(p.name for p in (repo / "refs").rglob("*")) == ["release", "v1"]


def test_a_ref_is_never_written_through_a_planted_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In a shared cache another user plants links where the ref's temporary file used to be
    # (its name was the pid's), at a ref itself, and at a folder on a ref's way.
    cache = tmp_path / "cache"
    victim = tmp_path / "home" / ".bashrc"
    victim.parent.mkdir(parents=True)
    victim.write_text("the victim's own file\n")
    refs = cache / "models--org--name" / "refs"
    refs.mkdir(parents=True)
    (refs / f"main.{os.getpid()}.weightmap.tmp").symlink_to(victim)
    repo, commit = _remember(cache, "main", monkeypatch)
    assert victim.read_text() == "the victim's own file\n"
    assert (repo / "refs" / "main").read_text() == commit and not (refs / "main").is_symlink()
    (refs / "tag").symlink_to(victim)  # (a link at the ref itself: never written through)
    _remember(cache, "tag", monkeypatch)
    assert victim.read_text() == "the victim's own file\n"
    (refs / "release").symlink_to(victim.parent)  # (a link on the way: nothing made past it)
    _remember(cache, "release/v1", monkeypatch)
    assert sorted(p.name for p in victim.parent.iterdir()) == [".bashrc"]
