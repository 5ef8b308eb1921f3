import sys

from .worker_cli import main

sys.exit(main())
