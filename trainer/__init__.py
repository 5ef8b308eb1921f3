"""The gptop training worker: knows nothing of gptop or optuna."""

from . import process_costs

# Before any module of the package imports torch, so it runs after every exit handler torch and the run
# register; it acts only where an entry point (`python -m trainer`, a tool) recorded its exit code.
process_costs.exit_without_teardown()
