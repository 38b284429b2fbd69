"""The properties of a real device the emulated npu can be given (:func:`shadow.npu.emulated.set_properties`), as
one setting reads them (``npu-shadow run --emulated-device``): no torch import."""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class DeviceProperties:
    """The properties of a device the emulated npu can be given (each off by default): a memory capacity per device
    in bytes, the device time of each queued kernel in seconds, the relative size of nondeterministic reductions,
    and their heavy tail (a lognormal's sigma: each kernel's size is the relative size times a draw of its own)."""

    capacity: int = 0
    kernel_time: float = 0.0
    nondeterministic: float = 0.0
    tail: float = 0.0

    @classmethod
    def parse(cls, text: str) -> DeviceProperties:
        """From ``capacity=8GiB,kernel_time=20us,nondeterministic=1e-6,tail=1.5`` (any of the four, in any order;
        sizes in B/KiB/MiB/GiB, times in s/ms/us); ``ValueError`` naming what is wrong."""
        fields: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            name, value = name.strip(), value.strip()
            if not sep or name not in _UNITS or name in fields:
                raise ValueError(
                    f"{item!r} is not capacity=SIZE, kernel_time=TIME, nondeterministic=RELATIVE or tail=SIGMA (each "
                    "once)"
                )
            fields[name] = _parse_quantity(name, value)
        properties = cls(**fields)
        if not 0 <= properties.kernel_time < 1 or not 0 <= properties.nondeterministic < 1:
            raise ValueError(f"kernel_time must be in [0, 1) s and nondeterministic in [0, 1), got {text!r}")
        if not 0 <= properties.tail <= 5:
            raise ValueError(f"tail is a lognormal's sigma in [0, 5], got {text!r}")
        return properties


_UNITS = {
    "capacity": {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30},
    "kernel_time": {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6},
    "nondeterministic": {"": 1.0},
    "tail": {"": 1.0},
}


def _parse_quantity(name: str, value: str) -> int | float:
    units = _UNITS[name]
    for unit in sorted(units, key=len, reverse=True):
        if unit and value.endswith(unit):
            number, scale = value[: -len(unit)], units[unit]
            break
    else:
        number, scale = value, units[""]
    try:
        quantity = float(number) * scale
    except ValueError:
        named = ", ".join(u for u in units if u) or "none"
        raise ValueError(f"{name}={value!r} is not a number with a unit ({named})") from None
    if not math.isfinite(quantity) or quantity < 0:
        raise ValueError(f"{name}={value!r} must be a finite number >= 0")
    return int(quantity) if name == "capacity" else quantity
