"""benchmarks/async_mix.py on kiln-tiny (CPU): both settings run the mixed batch to the same
token count, structured answers that completed parse. The script the device runs cannot rot
between GPU sessions."""

import os
import re
import shutil
import subprocess
import sys

from kiln.zoo import model_path

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "async_mix.py")


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, *args, "--num-requests", "8", "--input-len", "12",
         "--output-len", "16", "--orders", "on,off"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_async_mix_runs_both_settings():
    run = run_script("--model", "kiln-tiny", "--load-format", "auto")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = re.findall(r"async (on|off): (\d+) output tokens", run.stdout)
    assert [order for order, _ in lines] == ["on", "off"], run.stdout
    assert lines[0][1] == lines[1][1], run.stdout  # the same greedy / seeded outputs


def test_a_config_only_folder_borrows_a_tokenizer(tmp_path):
    """The workloads' folders hold a config alone (dummy weights): the grammars get kiln-tiny's
    tokenizer beside it, and the folder itself is left as it was."""
    shutil.copy(model_path("kiln-tiny") / "config.json", tmp_path)
    run = run_script("--model", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "has no tokenizer: kiln-tiny's beside its config" in run.stdout
    assert len(re.findall(r"async (?:on|off): \d+ output tokens", run.stdout)) == 2, run.stdout
    assert sorted(os.listdir(tmp_path)) == ["config.json"]
