#!/usr/bin/env bash
# Run the EAGLE-3 forward equivalence test and the fp8 (de)quantization comparison on an
# accelerator machine, in one command:
#
#     tests/gpu/run.sh
#
# Uses $PYTHON if set, else the repository's .venv, else python3; installs the project with its
# test extras only when something is missing (the machine may be offline: then src/ is put on
# PYTHONPATH, which is all the forward test needs). Refuses to run without CUDA unless
# WEIGHTMAP_ALLOW_CPU=1. Writes under $OUT (a fresh temporary folder when unset):
#   forward-pytest.log     the full pytest -v output
#   forward-junit.xml      pytest's JUnit report
#   forward-report.jsonl   one line of measured differences per case
#   device-report.jsonl    one line per fp8 case: elements that differ from the CUDA reference
#   forward-summary.json   GPU, driver, torch / CUDA versions, outcome, per-case differences
#   forward-summary.md     the same as a table, ready for docs/gpu-check.md
# Exit status: pytest's.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT_DIR=${OUT:-$(mktemp -d -t weightmap-gpu.XXXXXX)}
mkdir -p "$OUT_DIR"
cd "$ROOT"

if [[ -n "${PYTHON:-}" ]]; then
    PY=$PYTHON
elif [[ -x .venv/bin/python ]] && .venv/bin/python -c "import torch" 2>/dev/null; then
    PY=.venv/bin/python
else
    PY=$(command -v python3)
fi
echo "python: $PY"

have() { "$PY" -c "import $1" 2>/dev/null; }
if ! (have torch && have pytest && have safetensors && have numpy && have hypothesis && have weightmap); then
    echo "installing the project and its test extras"
    "$PY" -m pip install -q -e ".[test]" \
        || "$PY" -m pip install -q --no-build-isolation --no-deps -e . \
        || echo "install failed (offline?); continuing with what is there"
fi
if ! have weightmap; then
    export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
fi
for mod in torch pytest safetensors; do
    have "$mod" || { echo "error: $PY cannot import $mod" >&2; exit 2; }
done
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    if [[ "${WEIGHTMAP_ALLOW_CPU:-0}" != 1 ]]; then
        echo "error: torch sees no CUDA device (set WEIGHTMAP_ALLOW_CPU=1 to run on the CPU)" >&2
        exit 2
    fi
    echo "warning: no CUDA device, running on the CPU"
fi

export WEIGHTMAP_FORWARD_REPORT="$OUT_DIR/forward-report.jsonl"
export WEIGHTMAP_DEVICE_REPORT="$OUT_DIR/device-report.jsonl"
rm -f "$WEIGHTMAP_FORWARD_REPORT" "$WEIGHTMAP_DEVICE_REPORT"
set +e
"$PY" -m pytest -m "forward or device" -v -p no:cacheprovider --continue-on-collection-errors \
    --junitxml "$OUT_DIR/forward-junit.xml" 2>&1 | tee "$OUT_DIR/forward-pytest.log"
status=${PIPESTATUS[0]}
set -e

"$PY" - "$OUT_DIR" "$status" <<'PYEOF'
import json
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

out, status = Path(sys.argv[1]), int(sys.argv[2])
cuda = torch.cuda.is_available()
try:
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=30, check=False,
    ).stdout.strip()
except OSError:
    smi = ""
counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
junit = out / "forward-junit.xml"
if junit.is_file():
    for suite in ET.parse(junit).getroot().iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
report = out / "forward-report.jsonl"
cases = [json.loads(line) for line in report.read_text().splitlines()] if report.is_file() else []
fp8 = out / "device-report.jsonl"
fp8_cases = [json.loads(line) for line in fp8.read_text().splitlines()] if fp8.is_file() else []
summary = {
    "gpu": torch.cuda.get_device_name(0) if cuda else None,
    "nvidia_smi": smi or None,
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "python": platform.python_version(),
    "pytest_exit_status": status,
    **counts,
    "dtypes": sorted({c["dtype"] for c in cases}),
    "cases": cases,
    "fp8_cases": fp8_cases,
}
(out / "forward-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
lines = [
    "# EAGLE-3 forward equivalence check",
    "",
    f"- device: {summary['gpu'] or 'CPU'}" + (f" ({smi})" if smi else ""),
    f"- torch {summary['torch']}, CUDA {summary['cuda']}, Python {summary['python']}",
    f"- pytest exit status {status}: {counts['tests']} tests, {counts['failures']} failed, "
    f"{counts['errors']} errors, {counts['skipped']} skipped",
    "",
    "| case | dtype | device | max abs diff logits (tol) | max abs diff hidden (tol) "
    "| tokens compared |",
    "|---|---|---|---|---|---|",
]
for c in cases:
    lines.append(
        f"| {c['case']} | {c['dtype']} | {c['device']} "
        f"| {c['max_abs_diff_logits']:.3g} ({c['tol_logits']:.3g}) "
        f"| {c['max_abs_diff_hidden']:.3g} ({c['tol_hidden']:.3g}) "
        f"| {c['tokens_compared']}/{c['tokens_total']} |"
    )
lines += [
    "",
    "| fp8 case | reference on | elements that differ | scales that differ |",
    "|---|---|---|---|",
]
for c in fp8_cases:
    lines.append(
        f"| {c['case']} | {c['device']} | {c['elements_differ']} | {c.get('scales_differ', '-')} |"
    )
(out / "forward-summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
echo "results in $OUT_DIR"
exit "$status"
