import sys

from .process_costs import pause_gc_for_startup, set_exit_code

pause_gc_for_startup()  # before torch's import, which the next line starts

from .worker_cli import main  # noqa: E402

sys.exit(set_exit_code(main()))
