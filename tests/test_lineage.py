"""kappa.runtime.lineage: batch boundaries carried by Delta commits (pure parsing; the real path is in test_replay)."""

from __future__ import annotations

import json

from kappa.runtime.lineage import batch_metadata, batches_from_history, parse_offset_log
from kappa.runtime.lineage import BatchBoundary

# the layout Spark writes to <checkpoint>/offsets/<batch id> (version, metadata, one line per source)
OFFSET_LOG = "\n".join([
    "v1",
    json.dumps({"batchWatermarkMs": 1700000040000, "batchTimestampMs": 1763700000000,
                "conf": {"spark.sql.shuffle.partitions": "4"}}),
    json.dumps({"t-ad-events": {"2": 530, "1": 512, "3": 498, "0": 505}}),
])


def test_offset_log_entry_parses_to_end_offsets_and_watermark() -> None:
    assert parse_offset_log(OFFSET_LOG, "t-ad-events") == ({0: 505, 1: 512, 2: 530, 3: 498}, 1700000040000)
    assert parse_offset_log(OFFSET_LOG, "other") == ({}, 1700000040000)
    assert parse_offset_log("v1\n{}\n-\n", "t") == ({}, 0)


def test_history_gives_back_every_batch_of_one_run_in_order() -> None:
    def commit(app: str, batch: int, wm: int) -> dict:
        return {"operation": "MERGE", "userMetadata": batch_metadata(
            app_id=app, batch_id=batch, topic="t", end_offsets={1: batch * 10 + 1, 0: batch * 10}, watermark_ms=wm)}

    history = [commit("kappa:v@v2:r1", b, 1000 * b) for b in (3, 2, 1, 0)]  # Delta lists newest first
    history += [commit("kappa:v@v2:old-run", 9, 5), {"operation": "CREATE TABLE"}, {"userMetadata": "{not json"},
                {"userMetadata": json.dumps({"kappa": {"app_id": "kappa:v@v2:r1"}})}, {"userMetadata": "note"}]
    got = batches_from_history(history, "kappa:v@v2:r1")
    assert got == [BatchBoundary(b, {0: b * 10, 1: b * 10 + 1}, 1000 * b) for b in range(4)]
    assert [b.batch_id for b in batches_from_history(history, "kappa:v@v2:r1", upto=1)] == [0, 1]
    assert batches_from_history(history, "kappa:v@v2:nope") == []
    meta = json.loads(history[0]["userMetadata"])["kappa"]
    assert meta == {"app_id": "kappa:v@v2:r1", "batch": 3, "topic": "t", "end_offsets": {"0": 30, "1": 31},
                    "watermark_ms": 3000}


def test_a_raised_watermark_the_engine_has_not_applied_yet_is_pending(tmp_path) -> None:
    """The checkpoint layout Spark writes: offsets/<N> has the batch's watermark, commits/<N> the next one."""
    from kappa.runtime.checkpoint import pending_watermark

    main = tmp_path / "main"
    assert pending_watermark(str(main)) is None  # nothing committed yet
    (main / "offsets").mkdir(parents=True)
    (main / "commits").mkdir()

    def batch(n: int, watermark: int, nxt: int) -> None:
        (main / "offsets" / str(n)).write_text(OFFSET_LOG.replace("1700000040000", str(watermark)))
        (main / "commits" / str(n)).write_text("v1\n" + json.dumps({"nextBatchWatermarkMs": nxt}))

    batch(0, 0, 1700000064950)  # one big batch read everything: its windows close only in the next batch
    assert pending_watermark(str(main)) == (0, 1700000064950)
    (main / "offsets" / "1").write_text(OFFSET_LOG.replace("1700000040000", "1700000064950"))
    assert pending_watermark(str(main)) == (0, 1700000064950)  # planned, not committed: still owed
    batch(1, 1700000064950, 1700000064950)  # the no-data batch ran
    assert pending_watermark(str(main)) is None
