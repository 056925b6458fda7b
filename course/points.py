"""Points, partial credit and late penalties: how class grading turns test results into a score.

    points = Points.load()                 # course/points.toml, overridden by an instructor's file
    points.of("03_training", "3.3")        # 3 (points the exercise is worth)
    points.score(exercise)                 # (earned, worth, tests passed, tests counted)
    LatePolicy.parse("10%/day, max 50%")   # penalty(seconds late) -> fraction taken off

The course's points per exercise live in course/points.toml (see its header); `make grade-class
POINTS=my.toml` (and `make gradescope`, `make release GRADER=`) merge an instructor's file over them.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

COURSE_POINTS = Path(__file__).with_name("points.toml")
PARTIAL = ("tests", "all")


@dataclass
class Points:
    default: float = 1
    partial: str = "tests"
    table: dict[str, dict[str, float]] = field(default_factory=dict)  # {lesson stem: {exercise: points}}
    partial_of: dict[str, str] = field(default_factory=dict)  # {exercise: "tests" | "all"}

    @classmethod
    def load(cls, override: str | Path | None = None, partial: str | None = None) -> Points:
        """The course's points (course/points.toml), with `override`'s values (a file of the same form)
        and `partial` ("tests" | "all") on top."""
        out = cls()
        for path in [COURSE_POINTS, override]:
            if path is None or not Path(path).exists():
                if path is not None and path != COURSE_POINTS:
                    raise SystemExit(f"points file {path}: not found")
                continue
            try:
                data = tomllib.loads(Path(path).read_text())
            except tomllib.TOMLDecodeError as exc:
                raise SystemExit(f"points file {path}: {exc}") from None
            out.default = float(data.get("default", out.default))
            out.partial = str(data.get("partial", out.partial))
            for stem, table in data.get("points", {}).items():
                out.table.setdefault(stem, {}).update({str(k): float(v) for k, v in table.items()})
            out.partial_of.update({str(k): str(v) for k, v in data.get("partial_of", {}).items()})
        if partial:
            out.partial, out.partial_of = partial, {}
        for rule in [out.partial, *out.partial_of.values()]:
            if rule not in PARTIAL:
                raise SystemExit(f"partial credit must be one of {', '.join(PARTIAL)}; got {rule!r}")
        return out

    def of(self, stem: str, exercise: str) -> float:
        return self.table.get(stem, {}).get(exercise, self.default)

    def rule(self, exercise: str) -> str:
        return self.partial_of.get(exercise, self.partial)

    def score(self, stem: str, exercise: str, status: str, tests: list[dict]) -> tuple[float, float, int, int]:
        """(points earned, points it is worth here, tests passed, tests counted) of one exercise.
        An exercise skipped here (no GPU) is worth 0; one with no notebook (missing, unreadable, two
        copies) earns 0 of its points."""
        worth = self.of(stem, exercise)
        if status == "skipped":
            return 0.0, 0.0, 0, 0
        counted = [t for t in tests if t.get("outcome") != "skipped"]
        passed = sum(t.get("outcome") == "passed" for t in counted)
        if not counted or status in ("missing", "unreadable", "duplicate", "not attempted"):
            return 0.0, worth, passed, len(counted)
        if self.rule(exercise) == "all":
            return (worth if status == "passed" else 0.0), worth, passed, len(counted)
        return round(worth * passed / len(counted), 2), worth, passed, len(counted)


UNITS = {"minute": 60, "min": 60, "m": 60, "hour": 3600, "h": 3600, "day": 86400, "d": 86400, "week": 604800}


@dataclass
class LatePolicy:
    """A penalty for lateness: `per` (a fraction) taken off for each started `unit` (seconds) after the
    deadline and a grace period, at most `cap`. Written "10%/day", "2%/hour, max 50%", "10%/day, grace
    15m, max 30%", "zero" (a late submission scores 0) or "none"."""

    per: float = 0.0
    unit: int = 86400
    cap: float = 1.0
    grace: int = 0
    text: str = "none"

    @classmethod
    def parse(cls, text: str | None) -> LatePolicy:
        text = (text or "none").strip()
        low = text.lower()
        if low in ("none", "", "0"):
            return cls(text="none")
        if low == "zero":
            return cls(per=1.0, unit=1, cap=1.0, text="zero")
        out = cls(text=text)
        for part in (p.strip() for p in low.split(",")):
            if m := re.fullmatch(r"(\d+(?:\.\d+)?)\s*%\s*(?:/|per)\s*(\w+)", part):
                unit = m.group(2).rstrip("s") if m.group(2) not in UNITS else m.group(2)
                if unit not in UNITS:
                    raise SystemExit(f"late rule {text!r}: unknown unit {m.group(2)!r} (minute, hour, day, week)")
                out.per, out.unit = float(m.group(1)) / 100, UNITS[unit]
            elif m := re.fullmatch(r"max\s*=?\s*(\d+(?:\.\d+)?)\s*%", part):
                out.cap = float(m.group(1)) / 100
            elif m := re.fullmatch(r"grace\s*=?\s*(\d+(?:\.\d+)?)\s*(\w+)", part):
                unit = m.group(2) if m.group(2) in UNITS else m.group(2).rstrip("s")
                if unit not in UNITS:
                    raise SystemExit(f"late rule {text!r}: unknown unit {m.group(2)!r}")
                out.grace = int(float(m.group(1)) * UNITS[unit])
            else:
                raise SystemExit(f"late rule {text!r}: cannot read {part!r} (write e.g. '10%/day, max 50%', "
                                 "'2%/hour, grace 15m', 'zero' or 'none')")
        if not out.per:
            raise SystemExit(f"late rule {text!r}: no rate (e.g. 10%/day)")
        return out

    def penalty(self, late_seconds: float) -> float:
        """The fraction of the score taken off (0 when on time or within the grace period)."""
        if late_seconds <= self.grace or self.per == 0:
            return 0.0
        return min(self.cap, self.per * math.ceil((late_seconds - self.grace) / self.unit))


def parse_time(text: str) -> datetime:
    """An ISO 8601 time ('2026-03-01T23:59', '2026-03-01 23:59:00+01:00', '...Z'); naive means local time."""
    t = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    return t if t.tzinfo else t.astimezone()


def duration(seconds: float) -> str:
    """'2 d 3 h', '5 h 12 min', '40 min', '12 s'."""
    s = int(round(seconds))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d} d {h} h" if h else f"{d} d"
    if h:
        return f"{h} h {m} min" if m else f"{h} h"
    return f"{m} min" if m else f"{s} s"


def now() -> datetime:
    return datetime.now(timezone.utc)
