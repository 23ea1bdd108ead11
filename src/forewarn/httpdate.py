"""RFC 1123 dates, as HTTP's Date header and IMDS's NotBefore write them: `Tue, 24 Nov 2026 09:30:00 GMT`.

Written here rather than by `email.utils` (or `http.server`, which uses it): an idle collector loads neither.
"""

from __future__ import annotations

DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def rfc1123(weekday: int, day: int, month: int, year: int, hour: int, minute: int, second: int) -> str:
    """The date in GMT; `weekday` 0 is Monday, `month` 1 is January."""
    return (f"{DAYS[weekday]}, {day:02d} {MONTHS[month - 1]} {year:04d} "
            f"{hour:02d}:{minute:02d}:{second:02d} GMT")
