"""Fixtures shared by the quantization tests."""

import pytest

TEXT = ("import os\n\ndef walk(top):\n    for name in os.listdir(top):\n        yield name\n"
        "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n") * 20


@pytest.fixture(scope="session")
def calib_file(tmp_path_factory):
    """A small calibration text of Python code."""
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(TEXT)
    return path
