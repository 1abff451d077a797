"""``python -m kiln.serve --model ...``: the same server as ``kiln serve`` (logs at info)."""

import logging

from kiln.serve.cli import serve_command

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    serve_command(prog_name="python -m kiln.serve")
