"""``python -m kiln_trainer``: the trainer pod's entrypoint (see `kiln_trainer.cli`)."""

import logging
import os
import sys

from kiln_trainer import cli

if __name__ == "__main__":
    code = cli.main()
    # `cli.main` closed what it opened (process group, files, workers, servers); what is left
    # is the interpreter's teardown of torch's modules, measured at 0.5-1.2 CPU-s per process.
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nobody is left to read it
            pass
    os._exit(code)
