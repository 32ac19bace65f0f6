"""`python3 -m benchmarks.campaign ...`: the campaign's command line (benchmarks/campaign/runner.py)."""

import sys

from benchmarks.campaign.runner import main

if __name__ == "__main__":
    sys.exit(main())
