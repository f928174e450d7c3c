"""events_raw v2 - the archive also keeps the producer's ``event_id`` (schema ``ad_event`` v2).

A stateless change that only concerns records to come, so this version is declared ``upgrade="continue"``:
``kappa replay events_raw --version 2`` does not re-read the whole log - it seeds the new table with v1's rows
(their ``event_id`` is NULL: v1 did not keep it) and starts at the offsets v1 had reached
(:mod:`kappa.control.replay.upgrade`). ``--upgrade replay`` rebuilds it from the log instead, ``event_id``
filled for every record that carries one.
"""

from __future__ import annotations

from pyspark.sql import DataFrame

from jobs.events_raw.v1 import COLUMNS as V1_COLUMNS
from kappa.runtime.parsing import AD_EVENTS
from kappa.runtime.view import ViewDefinition

COLUMNS = (*V1_COLUMNS, "event_id")


def transform(events: DataFrame) -> DataFrame:
    """Every valid event, unchanged, with its event id and topic/partition/offset (pure)."""
    return events.select(*COLUMNS)


VIEW = ViewDefinition(
    name="events_raw",
    version=2,
    description="Append-only archive of valid ad events with their event_id and topic/partition/offset",
    stream_topic="ad-events",
    stream_format=AD_EVENTS,
    transform=transform,
    write="append",
    latency_column="event_ts",
    upgrade="continue",
)
