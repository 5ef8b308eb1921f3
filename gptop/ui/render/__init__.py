"""Rich renderables for the panels: pure functions of (RunState, width, height), one panel per module.

Kept apart from the widgets (gptop.ui.widgets) so each panel's content is easy to test and the widgets stay
thin: a widget's `render()` asks for its current size and calls one of these. Nothing here computes run logic;
numbers come from RunState. The bars and charts they share are in gptop.ui.render.drawing.
"""

from .alert_panel import alerts
from .breakdown_panel import breakdown, window_label
from .device_panel import devices
from .failure_panel import failure
from .run_header import header
from .training_panel import training
from .tuner_panel import tuner

__all__ = ["alerts", "breakdown", "devices", "failure", "header", "training", "tuner", "window_label"]
