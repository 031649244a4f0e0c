import sys

from batchknee.cli import main

sys.exit(main())
