"""JSON Schemas: shipped schemas valid and backward compatible; the checker rejects crafted breaks."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from kappa.log import schemas
from kappa.log.generator import MALFORMED_KINDS, events


def _write(root: Path, subject: str, version: int, schema: dict[str, Any]) -> None:
    (root / subject).mkdir(parents=True, exist_ok=True)
    (root / subject / f"v{version}.json").write_text(json.dumps(schema, indent=2))


@pytest.fixture
def ad_v1() -> dict[str, Any]:
    return schemas.load("ad_event", 1)


def test_shipped_schemas_are_compatible() -> None:
    assert schemas.subjects() == ["ad_event", "campaign", "campaign_window"]
    assert schemas.check_all() == []


def test_validate_good_and_bad_records() -> None:
    good = {"campaign_id": "7d3c2f0e-8c2b-4a43-9a4e-3f0b7c0c1a11"}
    schemas.validate("campaign", good)
    assert schemas.is_valid("campaign", {**good, "extra": 1})  # additionalProperties allowed
    with pytest.raises(schemas.SchemaValidationError, match="campaign_id"):
        schemas.validate("campaign", {})
    errs = schemas.errors("campaign", {"campaign_id": "not-a-uuid"})
    assert errs and errs[0].startswith("/campaign_id:")


def test_generator_output_matches_schema() -> None:
    """Valid generated events pass the schema; every malformed kind except null_key (a key problem) fails."""
    seen: set[str] = set()
    for ev in events(3000, seed=11, malformed_fraction=0.3, late_fraction=0.2):
        kind = ev.meta.kind
        seen.add(kind)
        try:
            obj = json.loads(ev.value)
        except ValueError:
            assert kind == "invalid_json"
            continue
        ok = schemas.is_valid("ad_event", obj)
        assert ok == (kind in ("valid", "null_key")), (kind, schemas.errors("ad_event", obj))
    assert seen == {"valid", *MALFORMED_KINDS}


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda s: (s["required"].append("country"), s["properties"].update(country={"type": "string"})),
         "new required field 'country' without a default"),
        (lambda s: s["properties"]["event_type"]["enum"].remove("purchase"), "enum value(s) removed: ['purchase']"),
        (lambda s: s["properties"]["event_time"].update(type="string"), "type narrowed"),
        (lambda s: s.update(additionalProperties=False), "additionalProperties became false"),
        (lambda s: s["properties"]["event_time"].update(minimum=10), "minimum narrowed: 0 -> 10"),
        (lambda s: s["properties"]["ip"].update(format="ipv6"), "format 'ipv6' changed"),
        (lambda s: s["properties"].update(geo={"oneOf": [{"type": "string"}]}), "unsupported keyword"),
    ],
    ids=["required-added", "enum-removed", "type-narrowed", "closed-content", "bound-narrowed", "format-changed",
         "unsupported"],
)
def test_incompatible_v2_is_rejected(tmp_path: Path, ad_v1: dict[str, Any], mutate: Any, expected: str) -> None:
    v2 = copy.deepcopy(ad_v1)
    mutate(v2)
    _write(tmp_path, "ad_event", 1, ad_v1)
    _write(tmp_path, "ad_event", 2, v2)
    issues = schemas.check_all(root=tmp_path)
    assert issues, "an incompatible v2 must be reported"
    text = "\n".join(map(str, issues))
    assert expected in text
    assert all(i.subject == "ad_event" and (i.old_version, i.new_version) == (1, 2) for i in issues)


def test_compatible_v2_is_accepted(tmp_path: Path, ad_v1: dict[str, Any]) -> None:
    v2 = copy.deepcopy(ad_v1)
    v2["properties"]["event_type"]["enum"].append("share")          # enum widened
    v2["properties"]["country"] = {"type": "string"}                  # optional field added
    v2["properties"]["region"] = {"type": "string", "default": "eu"}  # required, but with a default
    v2["required"].append("region")
    v2["properties"]["event_time"]["type"] = ["integer", "null"]      # type widened
    del v2["properties"]["ip"]["format"]                              # constraint removed
    _write(tmp_path, "ad_event", 1, ad_v1)
    _write(tmp_path, "ad_event", 2, v2)
    assert schemas.check_all(root=tmp_path) == []
    assert schemas.latest_version("ad_event", root=tmp_path) == 2


def test_version_gap_and_invalid_file_reported(tmp_path: Path, ad_v1: dict[str, Any]) -> None:
    _write(tmp_path, "ad_event", 1, ad_v1)
    _write(tmp_path, "ad_event", 3, ad_v1)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "v1.json").write_text("{nope")
    text = "\n".join(map(str, schemas.check_all(root=tmp_path)))
    assert "without gaps" in text and "not valid JSON" in text


def test_spark_schema_ddl() -> None:
    ddl = schemas.spark_schema("ad_event")
    assert ddl.startswith("`user_id` STRING, `page_id` STRING, `ad_id` STRING, `ad_type` STRING")
    assert "`event_time` BIGINT" in ddl
    assert schemas.spark_schema("campaign") == "`campaign_id` STRING"


def test_unknown_subject_and_version() -> None:
    with pytest.raises(schemas.SchemaError, match="unknown schema subject"):
        schemas.load("nope")
    with pytest.raises(schemas.SchemaError, match="no version 9"):
        schemas.load("ad_event", 9)
