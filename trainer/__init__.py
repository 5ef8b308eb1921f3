"""The gptop training worker: knows nothing of gptop or optuna."""
