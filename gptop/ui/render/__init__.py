"""Rich renderables for the panels (gptop.ui.render.drawing)."""

from .drawing import alerts, breakdown, devices, failure, header, training, tuner, window_label

__all__ = ["alerts", "breakdown", "devices", "failure", "header", "training", "tuner", "window_label"]
