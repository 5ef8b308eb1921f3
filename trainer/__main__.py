import sys

from .process_costs import set_exit_code
from .worker_cli import main

sys.exit(set_exit_code(main()))
