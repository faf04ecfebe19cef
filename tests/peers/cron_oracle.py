#!/usr/bin/env python3
"""The next fire times of cron expressions, by cronsim (an independent implementation, from PyPI).

Reads a JSON list of [expression, time zone, start (Unix seconds), count] on stdin; prints a JSON
list with, for each, the next `count` fire times strictly after the start, as Unix seconds. The
macros cronsim lacks are spelled out as cron defines them.
"""
import json
import sys
from datetime import datetime, timezone
from zoneinfo import ZoneInfo

from cronsim import CronSim

MACROS = {
    "@hourly": "0 * * * *",
    "@daily": "0 0 * * *",
    "@weekly": "0 0 * * 0",
    "@monthly": "0 0 1 * *",
    "@yearly": "0 0 1 1 *",
}


def fires(expression, zone, start, count):
    expression = MACROS.get(expression, expression)
    at = datetime.fromtimestamp(start, tz=timezone.utc).astimezone(ZoneInfo(zone))
    found = []
    for fire in CronSim(expression, at):
        found.append(int(fire.timestamp()))
        if len(found) == count:
            break
    return found


cases = json.load(sys.stdin)
json.dump([fires(*case) for case in cases], sys.stdout)
