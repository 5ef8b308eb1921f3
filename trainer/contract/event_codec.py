"""The wire codec of the event schema: the one `Codec` the events and their nested records are structs of,
what a line that does not fit raises, and how toggles decode (as a stored config's do)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .codec import Codec, Invalid, expected
from .common import ConfigError
from .config_schema import Toggles, section_from_dict


class MalformedEvent(ValueError):
    """A line or record that is not a valid event: bad JSON, a missing field, a field of the wrong type."""


# Turns the schema's classes into JSON objects and back (trainer.contract.codec): the events and their records
# register as its structs where they are declared.
CODEC = Codec(MalformedEvent)


def _toggles(x: Any) -> Toggles:
    """Toggles decoded once, as a stored config's are (an older version's values read as today's). A toggle
    this version does not know (a newer producer's) is left out rather than losing the whole event."""
    if isinstance(x, Toggles):
        return dataclasses.replace(x)  # the event's own copy: the producer's object may change later
    if not isinstance(x, dict):
        raise expected("a mapping of toggles", x)
    known = {f.name for f in dataclasses.fields(Toggles)}
    try:
        return section_from_dict(Toggles, {k: v for k, v in x.items() if k in known})
    except ConfigError as e:
        raise Invalid(str(e)) from None


CODEC.register(Toggles, decode=_toggles, encode=dataclasses.asdict)
