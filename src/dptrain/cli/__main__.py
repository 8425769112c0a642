"""``python -m dptrain.cli ...``: the same as the ``dptrain`` command."""

import sys

from dptrain.cli.main import main

if __name__ == "__main__":
    main()
