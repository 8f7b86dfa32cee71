"""Header validation: a table of malformed files, each with its specific rule, and valid edges."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from weightmap.errors import FormatError
from weightmap.format import header as header_module
from weightmap.format.dtypes import DTYPES
from weightmap.format.header import MAX_HEADER_SIZE, read_header

from sftools import entry, header_bytes, write_raw

F32x2 = entry("F32", [2], 0, 8)

# (id, header (dict or raw bytes), data, expected rule, text the message must contain)
MALFORMED: list[tuple[str, Any, bytes, str, str]] = [
    ("not-utf8", b'{"a\xff\xfe":1}', b"", "header-utf8", "not valid UTF-8"),
    ("not-json", b'{"a": ', b"", "header-json", "not valid JSON"),
    ("trailing-garbage", b'{"a": 1} xx', b"", "header-json", "not valid JSON"),
    (
        "nan",
        b'{"w": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 0]}}',
        b"",
        "header-json",
        "NaN",
    ),
    (
        "deep-nesting",
        b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        b"",
        "header-json",
        "nests deeper",
    ),
    ("not-object", b"[1, 2]", b"", "header-object", "not an object"),
    # An object where an array belongs is no empty array, however the decoder reads objects.
    (
        "shape-object",
        b'{"w": {"dtype": "U8", "shape": {}, "data_offsets": [0, 1]}}',
        b"\0",
        "shape",
        "non-negative",
    ),
    (
        "duplicate-key-in-entry",
        b'{"w": {"dtype": "U8", "shape": [1], "dtype": "U8"}}',
        b"\0",
        "duplicate-name",
        "'dtype' appears twice",
    ),
    (
        "duplicate-name",
        b'{"w": '
        + b'{"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}'
        + b', "w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}',
        b"\0\0",
        "duplicate-name",
        "appears twice",
    ),
    ("metadata-not-string", {"__metadata__": {"step": 5}}, b"", "metadata", "strings"),
    ("metadata-not-object", {"__metadata__": ["a"]}, b"", "metadata", "strings"),
    ("entry-not-object", {"w": [1, 2]}, b"", "tensor-entry", "not an object"),
    (
        "entry-missing-key",
        {"w": {"dtype": "F32", "shape": [2]}},
        b"\0" * 8,
        "tensor-entry",
        "missing data_offsets",
    ),
    (
        "entry-extra-key",
        {"w": {**F32x2, "stride": [1]}},
        b"\0" * 8,
        "tensor-entry",
        "unexpected stride",
    ),
    ("unknown-dtype", {"w": entry("F31", [2], 0, 8)}, b"\0" * 8, "dtype", "unknown dtype 'F31'"),
    ("dtype-not-string", {"w": {**F32x2, "dtype": 32}}, b"\0" * 8, "dtype", "unknown dtype 32"),
    ("negative-dim", {"w": entry("F32", [-2], 0, 8)}, b"\0" * 8, "shape", "non-negative"),
    ("bool-dim", {"w": entry("F32", [True, 2], 0, 8)}, b"\0" * 8, "shape", "non-negative"),
    ("float-dim", {"w": {**F32x2, "shape": [2.0]}}, b"\0" * 8, "shape", "non-negative"),
    ("offsets-triple", {"w": {**F32x2, "data_offsets": [0, 4, 8]}}, b"\0" * 8, "offsets", "pair"),
    ("offsets-negative", {"w": entry("F32", [0], -4, -4)}, b"", "offsets", "non-negative"),
    ("offsets-reversed", {"w": entry("F32", [2], 8, 0)}, b"\0" * 8, "offsets", "end before"),
    ("size-mismatch", {"w": entry("F32", [3], 0, 8)}, b"\0" * 8, "byte-size", "needs 12"),
    ("sub-byte", {"w": entry("F4", [3], 0, 2)}, b"\0\0", "byte-size", "whole number"),
    ("overflow", {"w": entry("F64", [2**32, 2**32, 2], 0, 8)}, b"\0" * 8, "overflow", "64 bits"),
    ("offset-overflow", {"w": entry("U8", [0], 2**64, 2**64)}, b"", "overflow", "64 bits"),
    ("hole", {"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 4, 6)}, b"\0" * 6, "hole", "hole"),
    (
        "overlap",
        {"a": entry("U8", [4], 0, 4), "b": entry("U8", [2], 2, 4)},
        b"\0" * 4,
        "overlap",
        "overlaps",
    ),
    ("start-not-zero", {"a": entry("U8", [2], 2, 4)}, b"\0" * 4, "hole", "hole"),
    ("trailing-bytes", {"w": F32x2}, b"\0" * 12, "trailing-bytes", "4 bytes after"),
    ("truncated-data", {"w": F32x2}, b"\0" * 5, "truncated", "truncated"),
]


@pytest.mark.parametrize(
    ("header", "data", "rule", "text"),
    [case[1:] for case in MALFORMED],
    ids=[case[0] for case in MALFORMED],
)
def test_malformed_header(tmp_path: Path, header: Any, data: bytes, rule: str, text: str) -> None:
    path = write_raw(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(FormatError) as info:
        read_header(path)
    assert info.value.rule == rule
    assert text in str(info.value)
    assert str(path) in str(info.value)


def test_malformed_table_is_large() -> None:
    assert len(MALFORMED) >= 20
    assert len({c[0] for c in MALFORMED}) == len(MALFORMED)


def test_error_names_the_tensor(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "x.safetensors", {"layers.3.w": entry("F32", [3], 0, 8)}, b"\0" * 8)
    with pytest.raises(FormatError, match=r"tensor 'layers.3.w'") as info:
        read_header(path)
    assert info.value.tensor == "layers.3.w"


@pytest.mark.parametrize(
    ("raw", "rule"),
    [
        (b"\x01\x02\x03", "too-small"),
        (struct.pack("<Q", MAX_HEADER_SIZE + 1) + b"{}", "header-too-large"),
        (struct.pack("<Q", 1000) + b"{}      ", "header-beyond-file"),
        (struct.pack("<Q", 2**64 - 1), "header-too-large"),
    ],
    ids=["too-small", "header-too-large", "header-beyond-file", "u64-max-length"],
)
def test_malformed_prefix(tmp_path: Path, raw: bytes, rule: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw)
    with pytest.raises(FormatError) as info:
        read_header(path)
    assert info.value.rule == rule


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="does not exist"):
        read_header(tmp_path / "nope.safetensors")
    with pytest.raises(FormatError, match="directory"):
        read_header(tmp_path)


def test_valid_edges(tmp_path: Path) -> None:
    header = {
        "__metadata__": {"format": "pt"},
        "scalar": entry("F32", [], 0, 4),
        "empty": entry("F16", [0, 3], 4, 4),
        "empty2": entry("I64", [5, 0], 4, 4),
        "fp4": entry("F4", [2, 3], 4, 7),
        "f6": entry("F6_E2M3", [4], 7, 10),
    }
    path = write_raw(tmp_path / "ok.safetensors", header, b"\0" * 10)
    h = read_header(path)
    assert set(h.tensors) == {"scalar", "empty", "empty2", "fp4", "f6"}
    assert h.tensors["scalar"].shape == ()
    assert h.tensors["fp4"].nbytes == 3
    assert h.metadata == {"format": "pt"}
    assert h.data_start == 8 + h.header_size


def test_whitespace_padding_before_and_after(tmp_path: Path) -> None:
    raw = b"   \n" + b'{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}' + b"\t  "
    path = write_raw(tmp_path / "pad.safetensors", raw, b"\x07", pad=False)
    assert read_header(path).tensors["w"].nbytes == 1


def test_empty_checkpoint_file(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "empty.safetensors", {})
    assert dict(read_header(path).tensors) == {}


def test_reads_reference_files(tmp_path: Path) -> None:
    tensors = {
        "a": torch.zeros(3, 4, dtype=torch.bfloat16),
        "b": torch.arange(5, dtype=torch.int64),
        "c": torch.zeros((), dtype=torch.float8_e4m3fn),
    }
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"k": "v"})
    h = read_header(tmp_path / "ref.safetensors")
    assert {n: (t.dtype, t.shape) for n, t in h.tensors.items()} == {
        "a": ("BF16", (3, 4)),
        "b": ("I64", (5,)),
        "c": ("F8_E4M3", ()),
    }


def test_header_prefix_helper_roundtrip() -> None:
    raw = header_bytes({"a": 1})
    assert struct.unpack("<Q", raw[:8])[0] % 8 == 0


def test_gc_pauses_nest_and_restore() -> None:
    """The collector is off inside any pause, on again after the last, and left off when it
    was off before (a caller's own gc.disable is kept)."""
    import gc
    import threading

    from weightmap.fs.gcpause import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    # Overlapping pauses in two threads: on again only once both have ended.
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            entered.set()
            release.wait(10)

    t = threading.Thread(target=other)
    with gc_paused():
        t.start()
        entered.wait(10)
    assert not gc.isenabled()  # the thread's pause is still on
    release.set()
    t.join()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_released_gc_pause_ends_once() -> None:
    """release ends a pause before its block does, once: the block's end then leaves a pause
    that began inside it alone."""
    import gc

    from weightmap.fs.gcpause import GcPause, gc_paused

    assert gc.isenabled()
    with gc_paused() as outer:
        assert isinstance(outer, GcPause)
        with gc_paused():
            outer.release()
            outer.release()
            assert not gc.isenabled()  # the inner pause still holds
        assert gc.isenabled()
        inner = GcPause().__enter__()
        assert not gc.isenabled()
    assert not gc.isenabled()  # the outer block's end did not end the other pause
    inner.release()
    assert gc.isenabled()


def test_plan_caches_never_travel_with_replace(tmp_path: Path) -> None:
    """Plan.output_specs is made once, and a plan made with dataclasses.replace has its own."""
    import dataclasses

    import weightmap

    save_file({"a": torch.zeros(2), "b": torch.zeros(3)}, tmp_path / "model.safetensors")
    plan = weightmap.compile(tmp_path, mapping='weightmap 1\nrename "{x}" -> "y.{x}"\n')
    assert plan.output_specs() is plan.output_specs()
    assert plan.output("y.a").name == "y.a"
    fewer = dataclasses.replace(plan, outputs=plan.outputs[1:])
    assert [s.name for s in fewer.output_specs()] == ["y.b"]
    with pytest.raises(KeyError):
        fewer.output("y.a")
    # A spec's kept size is no field: equal specs stay equal, and hash alike.
    s = plan.output_specs()[0]
    assert s.nbytes == 8
    twin = dataclasses.replace(s)
    assert twin == s and hash(twin) == hash(s)


def test_known_sizes_are_the_counted_sizes(tmp_path: Path) -> None:
    """Sizes taken from a header's byte ranges, and carried through renames to the plan's
    outputs, are what counting dtype x shape gives; a kept size changes no comparison."""
    import weightmap
    from weightmap.format.dtypes import TensorSpec, nbytes
    from weightmap.inputs.checkpoint import Checkpoint
    from weightmap.plan.plan import OutputTensor

    tensors = {
        "a": torch.zeros(3, 5, dtype=torch.bfloat16),
        "b": torch.zeros(0, 4),
        "c": torch.zeros((), dtype=torch.int64),
        "d": torch.zeros(7, dtype=torch.bool),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    with Checkpoint.open(tmp_path) as ckpt:
        for spec in ckpt.specs():
            assert spec.nbytes == nbytes(spec.dtype, spec.shape)
            assert spec == TensorSpec(spec.name, spec.dtype, spec.shape)
            assert hash(spec) == hash(TensorSpec(spec.name, spec.dtype, spec.shape))
    text = 'weightmap 1\nrename "{x}" -> "y.{x}" where x != "c"\nkeep "c"\n'
    plan = weightmap.compile(tmp_path, mapping=text)
    for out in plan.outputs:
        fresh = TensorSpec(out.name, out.node.dtype, out.node.shape)
        assert out.spec == fresh and out.spec.nbytes == nbytes(fresh.dtype, fresh.shape)
        rebuilt = OutputTensor(name=out.name, node=out.node, origin=out.origin)
        assert rebuilt == out and rebuilt.spec == out.spec
    again = type(plan).from_dict(plan.to_dict())
    assert again.output_specs() == plan.output_specs()


def test_a_renamed_spec_keeps_a_known_size_and_counts_none() -> None:
    """``TensorSpec.named``: another name, the same dtype and shape; a size read from a header
    goes with it, and a size nobody asked for is not counted on the way."""
    from weightmap.format.dtypes import TensorSpec

    plain = TensorSpec("a", "BF16", (3, 5))
    renamed = plain.named("b")
    assert renamed == TensorSpec("b", "BF16", (3, 5))
    assert renamed._nbytes is None  # not counted for the rename
    assert renamed.nbytes == 30 and plain._nbytes is None
    assert renamed._nbytes == 30  # counted once, then kept
    known = TensorSpec.sized("a", "BF16", (3, 5), 30).named("c")
    assert known._nbytes == 30 and known == TensorSpec("c", "BF16", (3, 5))
    assert repr(known) == "TensorSpec(name='c', dtype='BF16', shape=(3, 5))"
    assert hash(known) == hash(TensorSpec("c", "BF16", (3, 5)))


def test_slotted_value_types_stay_frozen_and_travel_whole() -> None:
    """Specs, source nodes and outputs are filled through their slots' setters
    (format/slots.py): they must still refuse assignment, compare on their fields alone, and
    pickle (Ray ships plans to its tasks) with the size or spec they keep."""
    import dataclasses
    import pickle

    from weightmap.format.dtypes import TensorSpec
    from weightmap.language.ast import Loc
    from weightmap.plan.nodes import Source
    from weightmap.plan.plan import OutputTensor

    spec = TensorSpec.sized("w", "F32", (2, 3), 24)
    node = Source.of("w", "F32", (2, 3))
    out = OutputTensor.of(spec.named("v"), node, Loc("m", 1, 1))
    assert node == Source(dtype="F32", shape=(2, 3), name="w")
    assert out == OutputTensor(name="v", node=node, origin=Loc("m", 1, 1))
    assert out.spec._nbytes == 24  # the spec it was made with, size and all
    for value in (spec, node, out):
        with pytest.raises(dataclasses.FrozenInstanceError):
            value.name = "x"  # type: ignore[misc]
        back = pickle.loads(pickle.dumps(value))
        assert back == value and hash(back) == hash(value)
    assert pickle.loads(pickle.dumps(out)).spec.nbytes == 24


def test_entry_keys_in_any_order(tmp_path: Path) -> None:
    """Writers put an entry's keys as dtype, shape, data_offsets; any other order reads the
    same (and a header with such entries reads as one written in the usual order)."""
    orders = [("dtype", "shape", "data_offsets"), ("data_offsets", "dtype", "shape"),
              ("shape", "data_offsets", "dtype")]  # fmt: skip
    headers = []
    for i, order in enumerate(orders):
        a, b = entry("F32", [2, 3], 0, 24), entry("U8", [4], 24, 28)
        raw = {"a": {k: a[k] for k in order}, "b": {k: b[k] for k in order}}
        headers.append(read_header(write_raw(tmp_path / f"{i}.safetensors", raw, b"\0" * 28)))
    assert all(h.tensors == headers[0].tensors for h in headers)
    assert headers[0].tensors["a"].shape == (2, 3) and headers[0].tensors["b"].end == 28


def test_a_text_file_in_place_of_a_shard_is_named_as_text(tmp_path: Path) -> None:
    # A JSON file or a git LFS pointer where a shard should be: its first 8 bytes read as a
    # huge header length, and the message says what the file really is.
    for name, text in (
        ("index.safetensors", '{"weight_map": {"x": "model.safetensors"}}'),
        ("lfs.safetensors", "version https://git-lfs.github.com/spec/v1\noid sha256:ab\n"),
    ):
        (tmp_path / name).write_text(text)
        with pytest.raises(FormatError, match=r"it is not a safetensors file .*too-large"):
            read_header(tmp_path / name)


def test_an_integer_of_thousands_of_digits_is_an_overflow(tmp_path: Path) -> None:
    # Python's int-parsing limit would otherwise suggest raising that limit.
    header = '{"x":{"dtype":"F32","shape":[' + "1" * 5001 + '],"data_offsets":[0,4]}}'
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(4))
    with pytest.raises(FormatError, match=r"thousands of digits.*\[overflow\]"):
        read_header(path)


@pytest.mark.parametrize("quick", [True, False])
def test_entries_share_their_dtype_name_and_shape(tmp_path: Path, quick: bool) -> None:
    """Every entry of one shape holds the same shape tuple, and the dtype table's name: a
    checkpoint of 100,000 tensors keeps one header entry per tensor for its lifetime. So with
    the quick decoder (which reads every plain header) and the strict one."""
    header = {"__metadata__": {"format": "pt"}}
    header |= {f"t.{i}": entry("BF16", [2, 3], 12 * i, 12 * (i + 1)) for i in range(4)}
    text = json.dumps(header)
    if quick:
        parsed = header_module._quick_header(text, False)
        assert parsed is not None
        infos = parsed[1]
    else:
        infos = header_module._checked_header(text, "h")[1]
    assert [i.shape for i in infos] == [(2, 3)] * 4
    assert all(i.shape is infos[0].shape for i in infos)
    assert all(i.dtype is DTYPES["BF16"].name for i in infos)
    write_raw(tmp_path / "m.safetensors", header, bytes(48))
    assert list(read_header(tmp_path / "m.safetensors").tensors.values()) == infos


def test_values_made_by_columns_are_the_values_made_one_by_one() -> None:
    """``sized_specs``, ``Source.many`` and ``OutputTensor.many`` (a whole checkpoint's at
    once, slot by slot) make what ``TensorSpec.sized``, ``Source.of`` and ``OutputTensor.of``
    make: equal, frozen, with the sizes and specs they keep, and pickled whole."""
    import dataclasses
    import pickle

    from weightmap.format.dtypes import TensorSpec, sized_specs
    from weightmap.language.ast import Loc
    from weightmap.plan.nodes import Source
    from weightmap.plan.plan import OutputTensor

    names, dtypes, shapes = ["a", "b", "c"], ["F32", "BF16", "U8"], [(2,), (3, 1), ()]
    sizes = [8, None, 1]
    specs = sized_specs(3, names, dtypes, shapes, sizes)
    sources = Source.many(3, names, dtypes, shapes)
    outs = OutputTensor.many(3, specs, sources, Loc("m", 2, 1))
    for i in range(3):
        want = TensorSpec.sized(names[i], dtypes[i], shapes[i], sizes[i] or 0)
        assert specs[i] == want and specs[i]._nbytes == sizes[i]
        assert sources[i] == Source.of(names[i], dtypes[i], shapes[i])
        assert outs[i] == OutputTensor.of(specs[i], sources[i], Loc("m", 2, 1))
        assert outs[i].spec is specs[i]
    assert specs[1].nbytes == 6  # (counted when first asked for)
    for value in (specs[0], sources[0], outs[0]):
        with pytest.raises(dataclasses.FrozenInstanceError):
            value.name = "x"  # type: ignore[misc]
        assert pickle.loads(pickle.dumps(value)) == value


def test_shared_keeps_one_object_per_distinct_value(tmp_path: Path) -> None:
    """``shared`` gives back the same values, each one object (the first met); a checkpoint's
    specs so share their byte sizes (an int above 256 is an object per computation)."""
    from weightmap.format.slots import shared
    from weightmap.inputs.checkpoint import Checkpoint

    values = [int("4096"), int("4096"), int("300"), int("4096")]
    assert values[1] is not values[0]
    out = shared(values)
    assert out == values and out[2] is values[2]
    assert all(out[i] is values[0] for i in (0, 1, 3))
    save_file({f"t{i}": torch.zeros(300) for i in range(3)}, str(tmp_path / "model.safetensors"))
    with Checkpoint.open(tmp_path) as ckpt:
        sizes = [spec._nbytes for spec in ckpt.specs()]
    assert sizes == [1200] * 3 and sizes[0] is sizes[1] is sizes[2]


def test_tensors_listed_out_of_order_or_empty_read_in_data_order(tmp_path: Path) -> None:
    """Entries listed in another order than their data, or empty ones, take the sorting and
    checking pass; entries back to back in order take none, and come out the same."""
    listed = {"b": entry("U8", [2], 2, 4), "e": entry("U8", [0], 4, 4), "a": entry("U8", [2], 0, 2)}
    header = read_header(write_raw(tmp_path / "x.safetensors", listed, b"\0" * 4))
    assert list(header.tensors) == ["a", "b", "e"]
    in_order = {"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 2, 4)}
    header = read_header(write_raw(tmp_path / "y.safetensors", in_order, b"\0" * 4))
    assert list(header.tensors) == ["a", "b"] and header.tensors["b"].end == 4
    with pytest.raises(FormatError) as err:
        read_header(write_raw(tmp_path / "z.safetensors", in_order, b"\0" * 3))
    assert err.value.rule == "truncated"
