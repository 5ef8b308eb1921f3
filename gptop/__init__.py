"""gptop: htop for a training run."""

__version__ = "0.1.0"
