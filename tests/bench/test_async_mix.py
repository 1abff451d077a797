"""benchmarks/async_mix.py on kiln-tiny (CPU): both settings run the mixed batch to the same
token count, structured answers that completed parse. The script the device runs cannot rot
between GPU sessions."""

import os
import re
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "async_mix.py")


def test_async_mix_runs_both_settings():
    run = subprocess.run(
        [sys.executable, SCRIPT, "--model", "kiln-tiny", "--load-format", "auto",
         "--num-requests", "8", "--input-len", "12", "--output-len", "16", "--orders", "on,off"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = re.findall(r"async (on|off): (\d+) output tokens", run.stdout)
    assert [order for order, _ in lines] == ["on", "off"], run.stdout
    assert lines[0][1] == lines[1][1], run.stdout  # the same greedy / seeded outputs
