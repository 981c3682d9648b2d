"""A tensor-parallel worker process: `python -m deltaserve.engine.rank RANK JSON`, as engine/workers.py starts it
(JSON: the engine's arguments, the model folder and the port; never pickle)."""

import json
import logging
import sys

from .config import EngineArgs
from .workers import worker_main

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(sys.argv[2])
    worker_main(int(sys.argv[1]), EngineArgs(**spec["args"]), spec["model"], spec["port"])
