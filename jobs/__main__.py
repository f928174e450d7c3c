"""``python -m jobs <view> --version N``: run one view-version driver (same as ``kappa view run``)."""

import sys

from kappa.cli import main

if __name__ == "__main__":
    main(["view", "run", *sys.argv[1:]])
