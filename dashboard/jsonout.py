"""JSON the browser can parse: NaN and infinities become null, bytes and other odd values a string.

DuckDB hands back NaN (an empty average), Decimal, timestamps and, from users' extra columns, any
Parquet type; Flask's default provider would write `NaN`, which `JSON.parse` rejects.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
import uuid
from typing import Any

from flask.json.provider import DefaultJSONProvider


class DashboardJSONProvider(DefaultJSONProvider):
    sort_keys = False

    def dumps(self, obj: Any, **kwargs: Any) -> str:
        kwargs.setdefault("allow_nan", False)
        return super().dumps(_finite(obj), **kwargs)

    @staticmethod
    def default(o: Any) -> Any:
        return plain_value(o)


def plain_value(value: Any) -> Any:
    """A DuckDB value as a JSON / CSV friendly one: timestamps in ISO 8601, bytes in hex, ..."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, list | tuple):
        return [plain_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain_value(v) for k, v in value.items()}
    return str(value)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj
