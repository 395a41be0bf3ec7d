"""``python -m kiln.controller``: the operator (same options as ``kiln operator``)."""

import sys

from kiln.controller import main

sys.exit(main.main(prog="python -m kiln.controller"))
