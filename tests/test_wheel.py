"""The built wheel ships grammars/ and mappings/ and loads them through the installed package."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

CHECK = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import weightmap
    from weightmap.language.resources import data_dir, read_text

    pkg = Path(weightmap.__file__).resolve().parent
    assert Path(sys.prefix).resolve() in pkg.parents, f"weightmap imported from {pkg}"
    for folder in ("grammars", "mappings"):
        d = data_dir(folder)
        assert Path(str(d)).resolve().parent == pkg, f"{folder} came from {d}"
        names = sorted(p.name for p in d.iterdir())
        assert names, f"{folder} is empty"
        text = read_text(folder, names[0])
        print(folder, names[0], len(text))

    # A preset from the installed wheel, compiled against the example checkpoint.
    import weightmap
    plan = weightmap.compile(sys.argv[1], preset="eagle3-sglang")
    assert len(plan.outputs) == 16, plan.explain()
    print("preset ok")
    """
)


@pytest.mark.slow
def test_wheel_installs_and_loads_package_data(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = dist.glob("weightmap-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # Install the wheel alone into the fresh environment; its dependencies come from the
    # test environment through a .pth line, which (unlike a site dir) does not pull in the
    # checkout's editable install.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--target",
            site,
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    example = REPO / "examples" / "eagle3-speculators"
    # A PYTHONPATH pointing at a checkout's src/ would win over the installed wheel.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [str(py), "-c", CHECK, str(example)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert "grammars" in r.stdout and "mappings" in r.stdout and "preset ok" in r.stdout
