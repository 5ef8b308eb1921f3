import sys

from .process_costs import exit_without_teardown, pause_gc_for_startup, set_exit_code

exit_without_teardown()  # first, so it runs after every exit handler torch and the run register
pause_gc_for_startup()

from .worker_cli import main  # noqa: E402  (after the two above: they must precede torch's import)

sys.exit(set_exit_code(main()))
