"""The gptop training worker: knows nothing of gptop or optuna."""

from . import process_costs

# Before any module of the package imports torch, so it runs after every exit handler torch and the run
# register; it acts only where an entry point (`python -m trainer`, a tool) recorded its exit code.
process_costs.exit_without_teardown()
if process_costs.started_as(process_costs.PAUSING_ENTRY_POINTS):
    process_costs.pause_gc_for_startup()  # before the entry point's module imports torch
