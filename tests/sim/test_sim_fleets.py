"""Reading an attached fleet's state file: what the simulator needs from it, and clear errors
for a file that is not one (the fleet itself is exercised in
tests/system/test_attached_local.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleet_sim.sim.fleets import AttachedError, AttachedFleet


def state(tmp_path: Path, **changes: Any) -> Path:
    data: dict[str, Any] = {
        "edge_url": "http://127.0.0.1:8080",
        "edge_metrics_url": None,
        "control_plane_url": "http://10.0.0.1:7800",
        "keys_dir": str(tmp_path / "keys"),
        "lease_s": 90,
        "replicas": [
            {"name": "r1", "slice": "a07", "url": "http://10.0.0.11:9101", "metrics_url": None},
            {
                "name": "r4",
                "slice": "a08",
                "url": "http://10.0.0.14:9101",
                "metrics_url": "http://127.0.0.1:19104/metrics",
            },
        ],
        "shards": {"a07-s1": "/export/a07-s1", "a08-s1": "/export/a08-s1"},
    }
    data.update(changes)
    path = tmp_path / "state.json"
    path.write_text(json.dumps({k: v for k, v in data.items() if v != "-"}))
    return path


def test_a_state_file_gives_urls_slices_shards_and_the_edge_budget(tmp_path: Path) -> None:
    config = tmp_path / "edge.toml"
    config.write_text(
        '[edge]\nretry_budget_s = 45\n\n[[slice]]\nname = "a07"\n'
        'replicas = [{ name = "r1", url = "http://10.0.0.11:9101" }]\n'
    )
    fleet = AttachedFleet.load(state(tmp_path, edge_config=str(config)))
    assert fleet.edge_url == "http://127.0.0.1:8080"
    assert fleet.edge_metrics_url is None
    assert {n: (s, r.url, r.metrics_url) for n, (s, r) in fleet.replicas.items()} == {
        "r1": ("a07", "http://10.0.0.11:9101", None),
        "r4": ("a08", "http://10.0.0.14:9101", "http://127.0.0.1:19104/metrics"),
    }
    assert fleet.shards == {"a07-s1": Path("/export/a07-s1"), "a08-s1": Path("/export/a08-s1")}
    assert fleet.retry_budget_s == 45.0 and fleet.lease_s == 90.0
    fleet.stop()  # never stops an attached fleet


def test_without_a_readable_edge_config_the_default_budget_is_assumed(tmp_path: Path) -> None:
    fleet = AttachedFleet.load(state(tmp_path, edge_config=str(tmp_path / "missing.toml")))
    assert fleet.retry_budget_s == 120.0


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"edge_url": "-"}, "edge_url"),
        ({"replicas": []}, "needs a list of replicas"),
        ({"shards": ["a07-s1"]}, "needs a list of replicas and a map of shards"),
        ({"replicas": [{"name": "r1", "url": "http://x"}]}, "slice"),
        ({"replicas": ["r1"]}, "not an attached fleet's state"),
        ({"lease_s": "soon"}, "not an attached fleet's state"),
    ],
)
def test_a_state_file_that_is_not_one_is_refused_clearly(
    tmp_path: Path, changes: dict[str, Any], says: str
) -> None:
    with pytest.raises(AttachedError, match=says):
        AttachedFleet.load(state(tmp_path, **changes))


def test_unreadable_or_non_json_files_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(AttachedError, match="cannot read"):
        AttachedFleet.load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(AttachedError, match="is not JSON"):
        AttachedFleet.load(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(AttachedError, match="expected a JSON object"):
        AttachedFleet.load(tmp_path / "list.json")
