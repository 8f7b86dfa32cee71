"""Fuzzing the three parsers: safetensors headers, checkpoint index/config, mapping programs.

The contract under test: any input yields either a valid result or one of weightmap's own
errors (a :class:`~weightmap.errors.WeightmapError`) — never another exception type, never a
hang (each example runs under a wall-clock alarm) and never memory far beyond the input.

Each hypothesis test has a fixed ``max_examples`` so the file fits a CI budget; the same
strategies (in ``tests/strategies.py``) and the oracles below drive the long-running
``fuzz/fuzz_parsers.py``. Inputs that once broke a parser are kept below as plain regression
tests.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import struct
import tempfile
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from strategies import (
    EXAMPLE,
    PRESET,
    PROGRAMS,
    SHARDS,
    VALID_INDEX,
    byte_mutations,
    config_docs,
    header_entries,
    header_files,
    header_json,
    include_trees,
    index_docs,
    journal_docs,
    json_values,
    mutated_json,
    mutated_programs,
    params_cases,
    set_values,
    valid_journal,
)
from weightmap.compiler.compile import compile_plan
from weightmap.errors import FormatError, MappingError, WeightmapError
from weightmap.execute.inplace import recover
from weightmap.format import header as header_module
from weightmap.format.dtypes import DTYPES, U64_MAX, TensorSpec
from weightmap.format.header import MAX_HEADER_SIZE, Header, parse_header, read_header
from weightmap.format.layout import CONFIG_NAME, INDEX_NAME, JOURNAL_NAME, SINGLE_NAME
from weightmap.format.text import json_depth
from weightmap.inputs.checkpoint import Checkpoint
from weightmap.language.mapping import Mapping, load_mapping
from weightmap.plan.plan import Plan

T = TypeVar("T")

# Per-example wall-clock limit: every parser here handles small inputs in milliseconds.
EXAMPLE_TIMEOUT_S = 10.0
# CI budget per hypothesis test (the whole file runs in well under a minute on 2 cores).
CI_EXAMPLES = 500
CI = settings(
    max_examples=CI_EXAMPLES,
    deadline=None,  # the alarm below catches hangs; hypothesis deadlines flake under load
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


# ---------------------------------------------------------------- the oracle


class Hang(Exception):
    """An example ran past EXAMPLE_TIMEOUT_S."""


@contextlib.contextmanager
def time_limit(seconds: float = EXAMPLE_TIMEOUT_S) -> Iterator[None]:
    """Raise :class:`Hang` in the main thread after ``seconds`` of wall-clock time."""

    def on_alarm(signum: int, frame: object) -> None:
        raise Hang(f"example ran longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def ours(fn: Callable[[], T]) -> T | None:
    """Run ``fn`` under the alarm: its result, or None for one of weightmap's own errors.

    Any other exception (KeyError, TypeError, RecursionError, MemoryError, ...) and
    :class:`Hang` propagate: they are findings.
    """
    with time_limit():
        try:
            return fn()
        except WeightmapError:
            return None


def utf8_clean(value: Any) -> None:
    """A valid result must be writable: every string in it encodes as UTF-8 (no surrogates)."""
    json.dumps(value, ensure_ascii=False, allow_nan=True).encode("utf-8")


def check_header(header: Header, file_size: int) -> None:
    """Invariants of a header that parsed: fully indexed, back to back, sizes consistent."""
    position = 0
    for name, info in header.tensors.items():
        assert name == info.name and info.dtype in DTYPES
        assert info.begin == position and info.end >= info.begin
        assert all(isinstance(d, int) and d >= 0 for d in info.shape)
        assert info.nbytes * 8 == math.prod(info.shape) * DTYPES[info.dtype].bits
        position = info.end
    assert header.data_start + position == file_size == header.file_size
    assert header.header_size <= MAX_HEADER_SIZE
    utf8_clean(list(header.tensors))
    if header.metadata is not None:
        assert all(isinstance(v, str) for v in header.metadata.values())
        utf8_clean(dict(header.metadata))


def header_file_case(data: bytes, folder: Path) -> Header | None:
    """Target `header`: ``data`` as a whole file, through read_header and parse_header."""
    path = folder / "fuzz.safetensors"
    path.write_bytes(data)
    header = ours(lambda: read_header(path))
    if header is not None:
        check_header(header, len(data))
    if len(data) >= 8:
        (size,) = struct.unpack("<Q", data[:8])
        raw = data[8 : 8 + min(size, MAX_HEADER_SIZE)]
        direct = ours(lambda: parse_header(raw, header_size=len(raw), file_size=len(data)))
        if direct is not None:
            check_header(direct, len(data))
    return header


def check_plan(plan: Plan) -> None:
    """Invariants of a plan that compiled: unique, writable output names."""
    names = [o.name for o in plan.outputs]
    assert len(names) == len(set(names))
    assert all(isinstance(n, str) and n and n != "__metadata__" for n in names)
    utf8_clean(names)
    if plan.config is not None:
        utf8_clean(plan.config)


def mapping_case(
    text: str, inputs: list[TensorSpec], config: dict[str, Any] | None, params: Any = None
) -> Plan | None:
    """Target `mapping`: load the text, then compile it against ``inputs`` and ``config``."""
    mapping: Mapping | None = ours(lambda: load_mapping(text, name="fuzz.wm"))
    if mapping is None:
        return None
    plan = ours(lambda: compile_plan(mapping, inputs, config, params=params))
    if plan is not None:
        check_plan(plan)
    return plan


# ---------------------------------------------------------------- shared fixtures (on disk)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> Path:
    """A valid safetensors file of zero-filled tensors."""
    raw = header_json(tensors)
    size = sum(math.prod(shape) * DTYPES[dtype].bits // 8 for dtype, shape in tensors.values())
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(size))
    return path


def make_sharded(folder: Path) -> Path:
    """Shards plus a symlink that escapes the folder and an outside file it points to."""
    folder.mkdir(parents=True, exist_ok=True)
    for shard, tensors in SHARDS.items():
        write_safetensors(folder / shard, tensors)
    outside = write_safetensors(folder.parent / "outside.safetensors", {"x": ("U8", [1])})
    with contextlib.suppress(FileExistsError):
        (folder / "escape.safetensors").symlink_to(outside)
    (folder / "sub").mkdir(exist_ok=True)
    return folder


def index_case(index: bytes, folder: Path) -> Checkpoint | None:
    """Target `index`: ``index`` as model.safetensors.index.json next to real shards."""
    (folder / INDEX_NAME).write_bytes(index)
    ckpt = ours(lambda: Checkpoint.open(folder))
    if ckpt is not None:
        assert set(ckpt) <= {n for ts in SHARDS.values() for n in ts}
        for path in ckpt.files:
            assert path.resolve().parent == folder.resolve()
    return ckpt


CONFIG_MAPPING = """weightmap 1
keep "**"
warn if has(config.a) and config.a == 1 "a is {config.a}"
config {
  if has(config.hidden_size) { width = config.hidden_size * 2 }
  if has(config.layers) and config.layers in [[1], [2]] { n = len(config.layers) }
  delete? num_layers, torch_dtype
  if has(config.rope_scaling) { move rope_scaling -> rope_parameters }
  if has(config.text_config) { lift text_config overwrite }
  copied = config
}
"""


def config_case(
    config: bytes, folder: Path, presets: list[tuple[Mapping, list[TensorSpec]]]
) -> None:
    """Target `config`: ``config`` as config.json; if it loads, compile config-reading mappings."""
    (folder / CONFIG_NAME).write_bytes(config)
    ckpt = ours(lambda: Checkpoint.open(folder))
    if ckpt is None:
        return
    cfg = ckpt.config
    utf8_clean(cfg)
    for mapping, inputs in presets:
        plan = ours(lambda mapping=mapping, inputs=inputs: compile_plan(mapping, inputs, cfg))
        if plan is not None:
            check_plan(plan)


def _tree_hashes(*roots: Path) -> dict[str, bytes]:
    out = {}
    for root in roots:
        for p in sorted(root.rglob("*")) if root.is_dir() else [root]:
            if p.is_file() and not p.is_symlink() and p.name != JOURNAL_NAME:
                out[str(p)] = p.read_bytes()
    return out


def make_journal_folder(folder: Path) -> Path:
    """A sharded checkpoint with its index and config, whose journal gets fuzzed, and a
    victim file beside it that no journal may touch."""
    make_sharded(folder)
    (folder / INDEX_NAME).write_text(json.dumps(VALID_INDEX))
    (folder / CONFIG_NAME).write_text('{"renamed": false}')
    (folder.parent / "victim.safetensors").write_bytes(b"precious")
    return folder


def journal_case(doc: bytes, folder: Path) -> None:
    """Target `journal`: ``doc`` as the journal; `clean` replays it or refuses it, and never
    writes outside the folder. The checkpoint is restored first."""
    for shard, tensors in SHARDS.items():
        write_safetensors(folder / shard, tensors)
    (folder / INDEX_NAME).write_text(json.dumps(VALID_INDEX))
    (folder / CONFIG_NAME).write_text('{"renamed": false}')
    (folder / JOURNAL_NAME).write_bytes(doc)
    outside = _tree_hashes(
        folder.parent / "victim.safetensors", folder.parent / "outside.safetensors"
    )
    before = _tree_hashes(folder)
    replayed = ours(lambda: recover(folder))
    assert (
        _tree_hashes(folder.parent / "victim.safetensors", folder.parent / "outside.safetensors")
        == outside
    )
    if replayed:
        assert not (folder / JOURNAL_NAME).exists()
        ckpt = ours(lambda: Checkpoint.open(folder))
        if ckpt is not None:
            ckpt.close()
    else:
        # Refused: not a byte written.
        assert _tree_hashes(folder) == before


def include_case(files: dict[str, str], folder: Path) -> Mapping | None:
    """Target `mapping` (includes): the files written, ``f0.wm`` loaded."""
    for old in folder.glob("*.wm"):
        old.unlink()
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8", errors="surrogatepass")
    return ours(lambda: load_mapping(folder / "f0.wm"))


SET_MAPPING = "weightmap 1\nparam p = null\nunmatched keep\nconfig { value = p }\n"


def set_case(value: str) -> None:
    """Target `mapping` (--set): the VALUE parsed as the command line does, then written into
    config.json by a mapping; what compiles must be strict JSON."""
    from weightmap.cli import UsageError, _params

    with time_limit():
        try:
            params = _params([f"p={value}"])
        except UsageError:
            return
    mapping = load_mapping(SET_MAPPING, name="set.wm")
    plan = ours(lambda: compile_plan(mapping, [TensorSpec("a", "F32", (1,))], {}, params=params))
    if plan is not None:
        check_plan(plan)
        json.dumps(plan.config, allow_nan=False)


# ---------------------------------------------------------------- hypothesis tests


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch folder shared by every example of a module (hypothesis reruns the body)."""
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real shards (and an escaping symlink) that fuzzed index files point at."""
    return make_sharded(tmp_path_factory.mktemp("fuzz-index") / "ckpt")


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-file checkpoint whose config.json gets fuzzed."""
    folder = tmp_path_factory.mktemp("fuzz-config")
    write_safetensors(folder / SINGLE_NAME, {"a.weight": ("F32", [2, 2])})
    return folder


@pytest.fixture(scope="module")
def journal_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint whose journal gets fuzzed (restored before each example)."""
    return make_journal_folder(tmp_path_factory.mktemp("fuzz-journal") / "ckpt")


def config_mappings() -> list[tuple[Mapping, list[TensorSpec]]]:
    """Mappings that read and edit config.json, with the inputs they compile against."""
    plain = [TensorSpec("a.weight", "F32", (2, 2))]
    example = list(Checkpoint.open(EXAMPLE).specs())
    return [
        (load_mapping(CONFIG_MAPPING, name="config.wm"), plain),
        (load_mapping(PRESET), example),
    ]


@CI
@given(data=st.binary(max_size=300))
def test_fuzz_header_arbitrary_bytes(workdir: Path, data: bytes) -> None:
    header_file_case(data, workdir)


@CI
@given(prefix=st.integers(0, U64_MAX), body=st.binary(max_size=200))
def test_fuzz_header_length_prefix(workdir: Path, prefix: int, body: bytes) -> None:
    header_file_case(struct.pack("<Q", prefix) + body, workdir)


@CI
@given(data=header_files())
def test_fuzz_header_mutated(workdir: Path, data: bytes) -> None:
    header_file_case(data, workdir)


@CI
@given(header=header_entries())
def test_fuzz_header_valid_ones_parse(workdir: Path, header: dict[str, Any]) -> None:
    # The generator's valid headers must parse, or the mutation tests mutate nonsense.
    raw = json.dumps(header).encode()
    data_len = max(
        (e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"), default=0
    )
    data = struct.pack("<Q", len(raw)) + raw + bytes(data_len)
    parsed = header_file_case(data, workdir)
    assert parsed is not None
    assert set(parsed.tensors) == set(header) - {"__metadata__"}


@CI
@given(raw=header_entries().flatmap(mutated_json))
def test_fuzz_header_quick_decoding_agrees_with_the_strict_one(raw: bytes) -> None:
    """The quick decoding of a plain header (objects as pairs, no Python call per object)
    accepts nothing the strict decoding and its rule-by-rule checks would not, with the same
    result."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return
    escapes = "\\u" in text
    with time_limit():
        quick = header_module._quick_header(text, escapes)
        try:
            strict = header_module._checked_header(text, "h")
        except FormatError:
            strict = None
    if quick is not None:
        assert quick == strict


def _parsed(raw: bytes, file_size: int, columns: bool) -> Header | tuple[str | None, str]:
    """The header ``raw`` parses to, read as columns where it can be or never so, or the
    rule and message of the error it gets."""
    patch = pytest.MonkeyPatch()
    if not columns:
        patch.setattr(header_module, "_column_header", lambda *args: None)
    try:
        with time_limit():
            return parse_header(raw, header_size=len(raw), file_size=file_size, path="h")
    except FormatError as exc:
        return exc.rule, str(exc)
    finally:
        patch.undo()


@st.composite
def writer_headers(draw: st.DrawFn) -> dict[str, Any]:
    """Headers as writers write them, mostly: names of a checkpoint's alphabet, tensors none
    empty; sometimes any header ``header_entries`` gives."""
    if draw(st.integers(0, 3)) == 0:
        return draw(header_entries())
    # Now and then a character JSON escapes (the decoders' then).
    odd = ["\x01", "\\", '"'] if draw(st.integers(0, 3)) == 0 else []
    alphabet = st.sampled_from([*"ab.0123_é€/:{}[],", *odd])
    names = draw(st.lists(st.text(alphabet, min_size=1, max_size=8), min_size=1, max_size=6))
    header: dict[str, Any] = {}
    if draw(st.booleans()):
        header["__metadata__"] = draw(
            st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2)
        )
    offset = 0
    for name in names:
        dtype = draw(st.sampled_from(["BF16", "F32", "I8", "F8_E4M3", "BOOL", "F4"]))
        shape = draw(st.lists(st.integers(1, 5), max_size=3))
        if DTYPES[dtype].bits == 4 and math.prod(shape) % 2:
            shape.append(2)
        size = math.prod(shape) * DTYPES[dtype].bits // 8
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    return header


@CI
@given(
    header=writer_headers(),
    compact=st.booleans(),
    ascii_only=st.booleans(),
    pad=st.integers(0, 9),
    mutate=st.integers(0, 5),
    data=st.data(),
)
def test_fuzz_header_columns_agree_with_the_decoders(
    header: dict[str, Any], compact: bool, ascii_only: bool, pad: int, mutate: int, data: Any
) -> None:
    """A header read as columns (one split of the text, a map per column) is the header the
    decoders read, for every header the columns take, mutated or not; one they do not take is
    left to the decoders, which say what is wrong with it."""
    # (json's default separators put spaces in; with ensure_ascii, escapes.)
    separators = (",", ":") if compact or mutate == 1 else None
    entries = [k for k in header if k != "__metadata__"]
    if mutate == 3 and entries:  # a shape that disagrees with its offsets
        entry = header[data.draw(st.sampled_from(entries))]
        entry["shape"] = [*entry["shape"], data.draw(st.integers(0, 3))]
    raw = json.dumps(header, separators=separators, ensure_ascii=ascii_only).encode()
    if mutate == 4 and entries and compact:  # by hand: a name twice, or the metadata last
        pairs = [(k, v) for k, v in header.items() if k != "__metadata__"]
        if "__metadata__" in header and data.draw(st.booleans()):
            pairs.append(("__metadata__", header["__metadata__"]))
        else:
            pairs.insert(data.draw(st.integers(0, len(pairs))), data.draw(st.sampled_from(pairs)))
        text = ",".join(
            json.dumps(k, ensure_ascii=False) + ":" + json.dumps(v, separators=(",", ":"))
            for k, v in pairs
        )
        raw = ("{" + text + "}").encode()
    raw += data.draw(st.sampled_from([b" "] * 6 + [b"\n", b"\t", b"\x0b", b"  \r"])) * pad
    size = max((header[k]["data_offsets"][1] for k in entries), default=0)
    file_size = 8 + len(raw) + size  # (a mutation leaves it as the header said)
    if mutate == 2:
        raw = data.draw(byte_mutations(raw))
    if mutate == 5:  # a file larger or smaller than the header says
        file_size += data.draw(st.sampled_from([-8, -1, 1, 2, 100]))
    taken: list[bool] = []
    real = header_module._column_header

    def spy(*args: Any) -> Any:
        found = real(*args)
        taken.append(found is not None)
        return found

    patch = pytest.MonkeyPatch()
    patch.setattr(header_module, "_column_header", spy)
    try:
        columns = _parsed(raw, file_size, True)
    finally:
        patch.undo()
    decoders = _parsed(raw, file_size, False)
    event(f"columns taken: {any(taken)}")
    assert columns == decoders
    if isinstance(columns, Header):
        assert columns.metadata == decoders.metadata  # type: ignore[union-attr]
        assert list(columns.tensors.values()) == list(decoders.tensors.values())  # type: ignore[union-attr]


def test_a_header_as_writers_write_it_is_read_as_columns() -> None:
    # (The property above holds trivially if the columns never take a header.)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "k": "é"}}
    for i in range(5):
        header[f"l.{i}.w"] = {
            "dtype": "BF16",
            "shape": [2, 3],
            "data_offsets": [12 * i, 12 * i + 12],
        }
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False) + "   "

    def columns(text: str) -> Any:
        size = len(text.encode())
        return header_module._column_header(text, size, 8 + size + 60)

    parsed = columns(text)
    assert parsed is not None
    metadata, table = parsed
    assert metadata == {"format": "pt", "k": "é"}
    assert table.names == [f"l.{i}.w" for i in range(5)]
    assert all(shape is table.shapes[0] for shape in table.shapes)
    assert table["l.3.w"] == header_module.TensorInfo("l.3.w", "BF16", (2, 3), 36, 48)
    # A hole, an empty tensor, keys in another order, a space, an escape: the decoders'.
    first = '{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]}'
    for old, new in [
        ('"data_offsets":[0,12]', '"data_offsets":[0,11]'),
        (first, '{"dtype":"BF16","shape":[0],"data_offsets":[0,0]}'),
        (first, '{"shape":[2,3],"dtype":"BF16","data_offsets":[0,12]}'),
        ('"l.2.w":{', '"l.2.w": {'),
        ('"l.2.w"', '"l.\\u0032.w"'),
    ]:
        assert columns(text.replace(old, new, 1)) is None, new


def _depth(value: Any) -> int:
    """json_depth's definition, recursively: a scalar 1, a container one more than its
    deepest item (an empty one 1)."""
    items = value.values() if isinstance(value, dict) else value
    if not isinstance(value, dict | list) or not items:
        return 1
    return 1 + max(_depth(v) for v in items)


@CI
@given(value=json_values(40), limit=st.integers(1, 6))
def test_fuzz_json_depth_is_the_depth(value: Any, limit: int) -> None:
    found = json_depth(value, 64)
    assert found == _depth(value)
    assert (json_depth(value, limit) > limit) == (found > limit)


@CI
@given(index=index_docs())
def test_fuzz_index(sharded: Path, index: bytes) -> None:
    index_case(index, sharded)


def test_fuzz_valid_index_opens(sharded: Path) -> None:
    ckpt = index_case(json.dumps(VALID_INDEX).encode(), sharded)
    assert ckpt is not None and len(ckpt) == 4


@settings(CI, max_examples=CI_EXAMPLES // 2)
@given(config=config_docs())
def test_fuzz_config(single: Path, config: bytes) -> None:
    config_case(config, single, _CONFIG_MAPPINGS)


@settings(CI, max_examples=200)
@given(doc=journal_docs())
def test_fuzz_journal(journal_folder: Path, doc: bytes) -> None:
    journal_case(doc, journal_folder)


def test_fuzz_valid_journal_replays(journal_folder: Path) -> None:
    journal_case(json.dumps(valid_journal("upper")).encode(), journal_folder)
    with Checkpoint.open(journal_folder) as ckpt:
        assert set(ckpt) == {n.upper() for ts in SHARDS.values() for n in ts}
        assert ckpt.config == {"renamed": True}


@settings(CI, max_examples=200)
@given(files=include_trees())
def test_fuzz_include_trees(workdir: Path, files: dict[str, str]) -> None:
    include_case(files, workdir)


@CI
@given(value=set_values())
def test_fuzz_set_values(value: str) -> None:
    set_case(value)


@CI
@given(text=st.text(max_size=200))
def test_fuzz_mapping_random_text(text: str) -> None:
    mapping_case(text, PROGRAMS[0][1], PROGRAMS[0][2])


@CI
@given(data=st.binary(max_size=200))
def test_fuzz_mapping_random_bytes(data: bytes) -> None:
    text = data.decode("utf-8", "surrogateescape")
    mapping_case("weightmap 1\n" + text, PROGRAMS[0][1], PROGRAMS[0][2])


@settings(CI, max_examples=CI_EXAMPLES * 2)
@given(case=mutated_programs())
def test_fuzz_mapping_mutated(case: tuple[str, list[TensorSpec], dict[str, Any] | None]) -> None:
    mapping_case(*case)


@CI
@given(case=params_cases())
def test_fuzz_mapping_params(
    case: tuple[str, list[TensorSpec], dict[str, Any] | None, Any],
) -> None:
    mapping_case(*case)


def test_fuzz_programs_compile_unmutated() -> None:
    # The mutation corpus must be valid, or mutations only ever test the error path.
    for text, specs, config in PROGRAMS:
        assert mapping_case(text, specs, config) is not None


_CONFIG_MAPPINGS = config_mappings()


# ---------------------------------------------------------------- memory


@contextlib.contextmanager
def memory_bound(input_size: int, slack: int = 32 * 2**20) -> Iterator[None]:
    """Fail when Python allocations peak above ``slack`` + 64 x the input size."""
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= slack + 64 * input_size, f"peak {peak} bytes for a {input_size}-byte input"


@settings(CI, max_examples=30)
@given(case=mutated_programs())
def test_fuzz_mapping_memory(case: tuple[str, list[TensorSpec], dict[str, Any] | None]) -> None:
    with memory_bound(len(case[0].encode("utf-8", "surrogatepass"))):
        mapping_case(*case)


@settings(CI, max_examples=30)
@given(data=header_files())
def test_fuzz_header_memory(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp, memory_bound(len(data)):
        header_file_case(data, Path(tmp))


# ---------------------------------------------------------------- regressions (findings)


# Each input below once raised a foreign exception or hung; now each gets our own error.


def _header(header: dict[str, Any], data_len: int) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(data_len)


def test_regression_huge_shape_list_is_fast(workdir: Path) -> None:
    # 80k dims of 2**62: the shape product took 11 s (quadratic); 100 MB headers took hours.
    data = _header({"a": {"dtype": "F32", "shape": [2**62] * 80_000, "data_offsets": [0, 4]}}, 4)
    (workdir / "big.safetensors").write_bytes(data)
    with time_limit(2.0), pytest.raises(FormatError) as err:
        read_header(workdir / "big.safetensors")
    assert err.value.rule == "overflow"


@pytest.mark.parametrize(
    "header",
    [
        {"\ud800": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}},
        {
            "__metadata__": {"k": "\udc00"},
            "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        },
    ],
)
def test_regression_header_lone_surrogate(header: dict[str, Any]) -> None:
    # json decodes "\ud800" to a str that no UTF-8 writer can write back.
    raw = json.dumps(header).encode()
    with pytest.raises(FormatError) as err:
        parse_header(raw, header_size=len(raw), file_size=8 + len(raw) + 1)
    assert err.value.rule == "header-utf8"


@pytest.mark.parametrize(
    "shard",
    [[], ["model-00001-of-00002.safetensors"], {"a": 1}, "x" * 5000, "x" * 300, "\ud800.st"],
    ids=["list", "list-of-name", "object", "name-5000", "name-300", "surrogate"],
)
def test_regression_index_hostile_shard(sharded: Path, shard: Any) -> None:
    # Were TypeError (unhashable), OSError (ENAMETOOLONG) and UnicodeEncodeError.
    weight_map = {**VALID_INDEX["weight_map"], "a.weight": shard}
    (sharded / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(WeightmapError) as err:
        Checkpoint.open(sharded)
    # A lone surrogate fails the whole index ("json") before any shard is looked at.
    assert err.value.rule in ("shard-name", "missing-shard", "json")  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "config", [b'{"a":' * 600 + b"1" + b"}" * 600, b'{"a": "\\ud800"}'], ids=["deep", "surrogate"]
)
def test_regression_config_refused(single: Path, config: bytes) -> None:
    # A 600-deep config loaded, then compiling raised RecursionError (copy.deepcopy); a lone
    # surrogate loaded and could not be written.
    (single / CONFIG_NAME).write_bytes(config)
    with pytest.raises(WeightmapError) as err:
        Checkpoint.open(single)
    assert err.value.rule == "json"  # type: ignore[attr-defined]


H = 'weightmap 1\nkeep "**"\n'
N = 2000


@pytest.mark.parametrize(
    "text",
    [
        H + "param a = " + "9" * 5000,  # int() refuses 4300+ digits: ValueError
        "weightmap " + "9" * 5000,
        H + "param a = " + "[" * N + "]" * N,  # RecursionError in the AST builder
        H + "param a = " + "+".join(["1"] * N),
        H + "param a = " + "-" * N + "1",
        H + "param a = " + "not " * N + "true",
        H + "param a = config" + ".a" * N,
        'weightmap 1\nrename "a.{x}" -> "b.{' + "+".join(["x"] * N) + '}"',
        H + "param a = [0] * 1000000000000",  # MemoryError
        H + "param a = [0] * 1000\nparam b = [[[1 for z in a] for y in a] for x in a]",  # hang
        H
        + "param a = 99999999999\n"  # squaring: 88 s, then ValueError printing the int
        + "".join(
            f"param a{i} = a{i - 1 if i else ''} * a{i - 1 if i else ''}\n" for i in range(22)
        ),
        H
        + 'param a = "xxxxxxxxxx"\n'  # doubling a string: memory
        + "".join(
            f"param a{i} = a{i - 1 if i else ''} + a{i - 1 if i else ''}\n" for i in range(30)
        ),
        H + "param a = len(1, 2)",  # EvalError (internal) escaped while compiling the call
        H + "param a = lenlen(1)",
        "0" * 300 + "\x80" * 200,  # Path.is_file: OSError ENAMETOOLONG
        "a\x00b",
        'weightmap 1\nrename "a.{x}" -> "{rest}"',  # EvalError from the output template
        'weightmap 1\nsplit "a.{x}" dim 1 sizes [1, 2] -> "{q}", "{r}"',
        'weightmap 1\nrename "a.{x}" -> "\\ud800{x}"',  # unwritable output name
        'weightmap 1\nkeep "**"\nconfig { x = "\\udc00" }',  # unwritable config
    ],
    ids=[
        "int-5000-digits",
        "version-5000-digits",
        "nested-list",
        "long-sum",
        "neg-chain",
        "not-chain",
        "attr-chain",
        "template-sum",
        "list-repeat",
        "nested-comprehension",
        "int-squaring",
        "string-doubling",
        "len-arity",
        "unknown-function",
        "one-line-too-long-for-a-path",
        "one-line-with-nul",
        "rename-unknown-name",
        "split-unknown-name",
        "surrogate-name",
        "surrogate-config",
    ],
)
def test_regression_mapping_refused(text: str) -> None:
    inputs = [TensorSpec("a.w", "F32", (2, 3))]
    with time_limit(), memory_bound(len(text)), pytest.raises(WeightmapError):
        compile_plan(load_mapping(text), inputs, {"a": 1})


@pytest.mark.parametrize(
    ("params", "config"),
    [
        ({"p": object()}, None),  # TypeError in Plan.build
        ({"p": [1, {2}]}, None),
        ({"p": b"x"}, None),
        ({"p": 2**15000}, None),  # ValueError printing it
        ({"p": "\ud800"}, None),
        ([1], None),  # AttributeError
        (None, [1]),  # TypeError
        (None, json.loads('{"a":' * 600 + "1" + "}" * 600)),  # RecursionError in deepcopy
        (None, {"a": 10**400}),  # OverflowError once multiplied by a float
    ],
    ids=[
        "object",
        "set",
        "bytes",
        "int-15000-bits",
        "surrogate",
        "params-list",
        "config-list",
        "config-deep",
        "config-huge-int",
    ],
)
def test_regression_compile_arguments(params: Any, config: Any) -> None:
    mapping = load_mapping('weightmap 1\nparam p = null\nrename "a.{x}" -> "b.{x}{p}"')
    with pytest.raises(WeightmapError):
        compile_plan(mapping, [TensorSpec("a.w", "F32", (2,))], config, params=params)


def test_fuzz_oracle_flags_foreign_errors() -> None:
    with pytest.raises(KeyError):
        ours(lambda: {}["x"])
    assert ours(lambda: (_ for _ in ()).throw(FormatError("x"))) is None


@pytest.mark.parametrize(
    ("target", "why"),
    [("/dev/zero", "not a regular file"), ("/proc/self/status.wm", "No such file")],
)
def test_include_of_a_special_file_is_refused(target: str, why: str) -> None:
    with pytest.raises(MappingError, match=why):
        load_mapping(f'weightmap 1\ninclude "{target}"\n')


def test_include_of_a_huge_file_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.wm"
    big.write_text("weightmap 1\n" + "# padding\n" * 200_000)
    with pytest.raises(MappingError, match="larger than 1,000,000 bytes"):
        load_mapping(f'weightmap 1\ninclude "{big}"\n')


def _entry_text(name: str, dtype: str, shape: str, begin: int, end: int) -> str:
    return f'"{name}":{{"dtype":"{dtype}","shape":[{shape}],"data_offsets":[{begin},{end}]}}'


# Headers in the writers' form but for one thing, each of which a rule refuses (or, last, which
# the decoders take and the columns leave to them): (text, bytes of data after the header).
_NOT_COLUMNS = {
    "trailing-bytes": ("{" + _entry_text("a", "U8", "4", 0, 4) + "}", 104),
    "truncated": ("{" + _entry_text("a", "U8", "4", 0, 4) + "}", 3),
    "duplicate-name": (
        "{" + _entry_text("a", "U8", "4", 0, 4) + "," + _entry_text("a", "U8", "4", 4, 8) + "}",
        8,
    ),
    "metadata-as-entry": (
        "{"
        + _entry_text("a", "U8", "4", 0, 4)
        + ","
        + _entry_text("__metadata__", "U8", "4", 4, 8)
        + "}",
        8,
    ),
    "leading-zero-dim": ("{" + _entry_text("a", "U8", "04", 0, 4) + "}", 4),
    "leading-zero-offset": (
        "{" + _entry_text("a", "U8", "4", 0, 4).replace("[0,", "[00,") + "}",
        4,
    ),
    "lone-surrogate-metadata": (
        '{"__metadata__":{"k":"\\ud800"},' + _entry_text("a", "U8", "4", 0, 4) + "}",
        4,
    ),
    "vertical-tab-after": ("{" + _entry_text("a", "U8", "4", 0, 4) + "}\x0b", 4),
    "offsets-past-2**63": (
        "{" + _entry_text("a", "U8", str(2**63), 0, 2**63) + "}",
        4,
    ),
    "empty-tensor": ("{" + _entry_text("a", "U8", "0", 0, 0) + "}", 0),
    "metadata-last": (
        "{" + _entry_text("a", "U8", "4", 0, 4) + ',"__metadata__":{"k":"v"}}',
        4,
    ),
    "newline-after": ("{" + _entry_text("a", "U8", "4", 0, 4) + "}\n", 4),
}


@pytest.mark.parametrize("case", sorted(_NOT_COLUMNS))
def test_a_header_the_columns_do_not_take_is_the_decoders(case: str) -> None:
    """Each rule the columns check, broken once: they leave the header to the decoders, which
    refuse it (or, for the last few, take it) as they always have."""
    text, data = _NOT_COLUMNS[case]
    raw = text.encode()
    file_size = 8 + len(raw) + data
    assert header_module._column_header(text, len(raw), file_size) is None
    assert _parsed(raw, file_size, True) == _parsed(raw, file_size, False)


def test_the_columns_take_the_plain_cases_beside_those() -> None:
    # (So the table above tests the checks, not a header the columns never take.)
    for text, data in [
        ("{" + _entry_text("a", "U8", "4", 0, 4) + "}", 4),
        ("{" + _entry_text("", "U8", "4", 0, 4) + "}   ", 4),
        ('{"__metadata__":{"k":"v"},' + _entry_text("a", "U8", "4", 0, 4) + "}", 4),
        (
            "{" + _entry_text("a", "U8", "4", 0, 4) + "," + _entry_text("b", "U8", "4", 4, 8) + "}",
            8,
        ),
    ]:
        raw = text.encode()
        assert header_module._column_header(text, len(raw), 8 + len(raw) + data) is not None
