"""Resident memory of computed conversions stays at the chunk budget, whatever the input size:
the input pages a chunk read are unmapped once it is written."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

# In a fresh process: warm torch's cast kernels, note the peak, convert, note the peak again.
JOB = textwrap.dedent(
    """
    import json, sys, torch, weightmap

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024

    torch.ones(4096, dtype=torch.bfloat16).to(torch.float32)
    torch.ones(4096, 64).t().contiguous()
    before = hwm()
    weightmap.remap(sys.argv[1], sys.argv[2], mapping=sys.argv[3], progress=False,
                    chunk_bytes=8 * 2**20, workers=2)
    print(json.dumps({"before": before, "after": hwm()}))
    """
)


def _peaks(tmp_path: Path) -> dict[str, float]:
    """Convert ``tmp_path/in`` with ``tmp_path/m.wm`` in a fresh process: its peaks, in MiB."""
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            JOB,
            str(tmp_path / "in"),
            str(tmp_path / "out"),
            str(tmp_path / "m.wm"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    peaks: dict[str, float] = json.loads(r.stdout.strip().splitlines()[-1])
    return peaks


@pytest.mark.parametrize(
    "mapping",
    [
        'weightmap 1\ncast "{x*}" to f32 where dtype == bf16\nunmatched keep\n',
        'weightmap 1\ntranspose "w{i:int}"\n',
    ],
    ids=["cast", "transpose"],
)
def test_peak_rss_does_not_grow_with_the_input(tmp_path: Path, mapping: str) -> None:
    src = tmp_path / "in"
    src.mkdir()
    # 8 tensors of 24 MiB (192 MiB): a process that kept the input mapped would grow by it.
    save_file(
        {f"w{i}": torch.full((3072, 4096), float(i), dtype=torch.bfloat16) for i in range(8)},
        src / "model.safetensors",
    )
    (tmp_path / "m.wm").write_text(mapping)
    peaks = _peaks(tmp_path)
    # The chunk budget (8 MiB over both threads), plus what torch allocates on the side
    # (16 MiB), plus for the transpose a gathered block and a band of mapped input per thread
    # (8 MiB each); the whole input is 192 MiB.
    assert peaks["after"] - peaks["before"] < 8 + 16 + 2 * 16, peaks


def test_a_join_of_eight_ranks_stays_within_the_chunk_budget(tmp_path: Path) -> None:
    """Eight rank files joined as Meta's are: along dim 1 (computed row by row, a piece of
    every rank per chunk) and along dim 0 with the rotary permute after it (a concatenation,
    a reshape's gather and a permute per chunk). The peak is the chunk budget and torch's
    side allocations, not the ranks' 192 MiB, and the bytes are the joined tensors'."""
    src = tmp_path / "in"
    src.mkdir()
    gen = torch.Generator().manual_seed(0)
    ranks = [
        {
            **{f"q{i}": torch.randn(384, 4096, generator=gen).bfloat16() for i in range(4)},
            **{f"o{i}": torch.randn(3072, 512, generator=gen).bfloat16() for i in range(4)},
        }
        for _ in range(8)
    ]
    for r, tensors in enumerate(ranks):
        save_file(tensors, src / f"consolidated.{r:02d}.safetensors")
    (tmp_path / "m.wm").write_text(
        "weightmap 1\n"
        'input ranks files "consolidated.{rank}.safetensors"\n'
        'merge "ranks:{r:int}:o{i:int}" dim 1 -> "o{i}"\n'
        'merge "ranks:{r:int}:q{i:int}" dim 0 -> "q{i}"\n'
        'reshape "q{i:int}" to [32, 48, 2, 4096]\n'
        'transpose "q{i:int}" dims [1, 2]\n'
        'reshape "q{i:int}" to [3072, 4096]\n'
    )
    peaks = _peaks(tmp_path)
    # The chunk budget (8 MiB over both threads), what torch allocates on the side (16 MiB),
    # and a piece of mapped input per thread; all eight ranks mapped would be 192 MiB.
    assert peaks["after"] - peaks["before"] < 8 + 16 + 2 * 16, peaks
    from safetensors.torch import load_file

    out = load_file(tmp_path / "out" / "model.safetensors")
    for i in range(4):
        joined = torch.cat([t[f"q{i}"] for t in ranks], 0)
        rotary = joined.view(32, 48, 2, 4096).transpose(1, 2).reshape(3072, 4096)
        assert torch.equal(out[f"q{i}"], rotary)
        assert torch.equal(out[f"o{i}"], torch.cat([t[f"o{i}"] for t in ranks], 1))


def test_a_transpose_does_not_keep_its_input_mapped(tmp_path: Path) -> None:
    """A transpose reads a column block of every input row per chunk: the pages it reads are
    unmapped band by band, so one 96 MiB tensor does not stay mapped while it is computed."""
    src = tmp_path / "in"
    src.mkdir()
    big = torch.arange(4096 * 12288, dtype=torch.int32).reshape(4096, 12288).to(torch.bfloat16)
    save_file({"w": big}, src / "model.safetensors")
    (tmp_path / "m.wm").write_text('weightmap 1\ntranspose "w"\n')
    peaks = _peaks(tmp_path)
    # The chunk budget and the gathered block (8 MiB each, on one thread: one tensor), a band
    # of mapped input (8 MiB, and the pages the kernel maps around it), what torch allocates
    # on the side; kept mapped, the input alone would be 96 MiB.
    assert peaks["after"] - peaks["before"] < 56, peaks
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["w"], big.t())


def test_an_fp8_dequantization_stays_within_the_chunk_budget(tmp_path: Path) -> None:
    """fp8 weights times their 128x128 block scales, to bf16, as DeepSeek-V3's checkpoints
    are dequantized: a chunk's intermediates are its float32 values alone (the scales are
    applied a band of block rows at a time, the fp8 bytes decoded in slices), not the
    expanded scales, the product and numpy's index copy beside them."""
    src = tmp_path / "in"
    src.mkdir()
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(8):
        w = torch.randn(3072, 4096, generator=gen).clamp(-400, 400)
        tensors[f"l{i}.weight"] = w.to(torch.float8_e4m3fn)
        tensors[f"l{i}.weight_scale_inv"] = torch.rand(24, 32, generator=gen) + 0.5
    save_file(tensors, src / "model.safetensors")
    (tmp_path / "m.wm").write_text(
        "weightmap 1\n"
        'mul "{x*}.weight", "{x*}.weight_scale_inv" block [128, 128] in f32 to bf16 '
        '-> "{x}.weight"\n'
        '    where dtype == f8_e4m3 or name == x + ".weight_scale_inv"\n'
    )
    peaks = _peaks(tmp_path)
    # The chunk budget (8 MiB over both threads), what torch and numpy allocate on the side
    # (16 MiB), a chunk's float32 values per thread (within the budget); the output is
    # 192 MiB, the input 96 MiB.
    assert peaks["after"] - peaks["before"] < 8 + 16 + 2 * 8, peaks
    from safetensors.torch import load_file

    out = load_file(tmp_path / "out" / "model.safetensors")
    for i in (0, 7):
        w, s = tensors[f"l{i}.weight"], tensors[f"l{i}.weight_scale_inv"]
        scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
        assert torch.equal(out[f"l{i}.weight"], (w.to(torch.float32) * scale).to(torch.bfloat16))
