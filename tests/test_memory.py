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
    r = subprocess.run(
        [sys.executable, "-c", JOB, str(src), str(tmp_path / "out"), str(tmp_path / "m.wm")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    peaks = json.loads(r.stdout.strip().splitlines()[-1])
    # The chunk budget (8 MiB over both threads), plus what torch allocates on the side
    # (16 MiB), plus for the transpose the input tensor each of the two threads reads out of
    # order (24 MiB each); the whole input is 192 MiB.
    assert peaks["after"] - peaks["before"] < 8 + 16 + 2 * 24, peaks
