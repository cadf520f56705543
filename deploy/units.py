"""One parser per unit: Kubernetes quantities (memory, shm) and durations (time limits)."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

# k8s.io/apimachinery pkg/api/resource: the whole quantity grammar (signs, exponents, milli).
_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$")
_SUFFIX = {"": 1, "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": 10**3,
           "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "Ki": 2**10,
           "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
# What the job file accepts for a memory size: a plain number and a binary or decimal suffix.
_MEMORY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")


def quantity(value: Any) -> Decimal | None:
    """The value of any Kubernetes quantity (`500m`, `1.5Gi`, `1e3`), None when it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return Decimal(str(value))
    match = _QUANTITY.match(str(value))
    if not match:
        return None
    number, suffix = match.group(1), match.group(2) or ""
    try:
        if suffix[:1] in ("e", "E"):
            return Decimal(number) * (Decimal(10) ** int(suffix[1:]))
        return Decimal(number) * Decimal(_SUFFIX[suffix])
    except (InvalidOperation, KeyError):
        return None


def parse_quantity(value: object) -> int:
    """Bytes in a Kubernetes memory quantity such as `256Gi`, `512M` or `1073741824`.

    Raises ValueError with a message meant for the user.
    """
    if isinstance(value, bool):
        raise ValueError("expected a memory quantity such as 32Gi or 512Mi")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("must not be negative")
        return value
    text = str(value).strip()
    if not _MEMORY.match(text):
        raise ValueError(
            f"{text!r} is not a Kubernetes quantity: write e.g. 32Gi, 512Mi or 8G"
        )
    return int(quantity(text))


def cpu_quantity(cpus: float) -> str:
    """CPUs as Kubernetes writes them: `2`, or `500m` for a fraction."""
    return str(int(cpus)) if float(cpus).is_integer() else f"{round(cpus * 1000)}m"


_DURATION_PART = re.compile(r"([0-9]+)(d|h|m|s)")
_DURATION_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(value: object) -> int:
    """Seconds in a duration such as `90m`, `24h`, `2d`, `1h30m` or a bare number of seconds."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 90m, 24h or 2d")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError("must be positive")
        return value
    text = str(value).strip()
    if text.isdigit():
        return parse_duration(int(text))
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"{text!r} is not a duration: write e.g. 90m, 24h, 2d or 1h30m")
    seconds = sum(int(n) * _DURATION_SECONDS[u] for n, u in parts)
    if seconds <= 0:
        raise ValueError("must be positive")
    return seconds


_SBATCH_TIME = re.compile(r"(?:([0-9]+)-)?([0-9]+)(?::([0-9]+))?(?::([0-9]+))?")


def parse_time_limit(value: object) -> int:
    """Seconds in `time_limit`, which means one thing on every target (Slurm `--time`,
    Kubernetes activeDeadlineSeconds):

    - a duration with units: `90m`, `24h`, `2d`, `1h30m`, `45s` (parse_duration);
    - sbatch's forms that name hours (sbatch(1) `--time`: "hours:minutes:seconds",
      "days-hours", "days-hours:minutes", "days-hours:minutes:seconds"): `04:00:00`,
      `2-12`, `1-00:30`, `1-12:00:00`; a job file's YAML keeps `04:00:00` a string.

    Refused, with the fix: a bare number, which sbatch reads as minutes and Kubernetes'
    activeDeadlineSeconds as seconds (ddpkit read it as seconds, a 60x surprise to a Slurm
    user), and sbatch's "minutes:seconds" (`90:00` reads as 90 minutes there and as 90 hours to
    anyone who writes HH:MM)."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 90m, 24h or 2d")
    text = str(value).strip()
    if isinstance(value, (int, float)) or re.fullmatch(r"[0-9]+(\.[0-9]*)?", text):
        example = f"{text}m" if text.isdigit() else "90m"
        raise ValueError(f"{text} is a bare number: sbatch reads it as minutes, Kubernetes as "
                         f"seconds; write the unit, e.g. {example}, 2h or 04:00:00")
    match = _SBATCH_TIME.fullmatch(text)
    if match is None:
        return parse_duration(text)
    days, first, second, third = match.groups()
    if days is None and third is None:  # MM:SS (MM alone is the bare number above)
        raise ValueError(f"{text!r} is sbatch's minutes:seconds, easily read as hours:minutes; "
                         f"write {int(first)}m{int(second)}s, or HH:MM:SS")
    if days is None:
        hours, minutes, seconds = first, second, third
    else:
        hours, minutes, seconds = first, second or "0", third or "0"
    if int(minutes) > 59 or int(seconds) > 59:
        raise ValueError(f"{text!r}: minutes and seconds go up to 59 (D-HH:MM:SS)")
    total = int(days or 0) * 86400 + int(hours) * 3600 + int(minutes) * 60 + int(seconds)
    if total <= 0:
        raise ValueError("must be positive (leave time_limit out for no limit)")
    return total


def format_duration(seconds: int) -> str:
    """The shortest `2d`, `1h30m`, `45s`-style spelling of a number of seconds."""
    out = []
    for unit, size in _DURATION_SECONDS.items():
        count, seconds = divmod(seconds, size)
        if count:
            out.append(f"{count}{unit}")
    return "".join(out) or "0s"


def slurm_time(seconds: int) -> str:
    """Slurm's `--time` spelling, D-HH:MM:SS, rounded up to whole minutes."""
    minutes = -(-seconds // 60)
    days, minutes = divmod(minutes, 1440)
    hours, minutes = divmod(minutes, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:00"
