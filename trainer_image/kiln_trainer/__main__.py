"""``python -m kiln_trainer``: the trainer pod's entrypoint (see `kiln_trainer.cli`)."""

import sys

from kiln_trainer import cli

if __name__ == "__main__":
    sys.exit(cli.main())
