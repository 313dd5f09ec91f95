"""The runtime's config file (what the operator mounts): types as strict as the policy's CRD."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from batchpilot_runtime.config import load_config

CONFIG: dict[str, Any] = {
    "policy": "p",
    "revision": "abc",
    "model": {"name": "m", "source": "builtin:tiny-mlp", "threads": 1},
    "lanes": [{"name": "a", "maxBatchSize": 8, "maxQueueDelay": "2ms", "maxQueueLength": 64, "requestTimeout": "1s"}],
}


def write(tmp_path: Path, lane_changes: dict[str, Any]) -> Path:
    cfg = json.loads(json.dumps(CONFIG))
    cfg["lanes"][0].update(lane_changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_config_loads_with_duration_strings_or_seconds(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, {"maxQueueDelay": 0.002}))
    assert cfg.lanes[0].max_queue_delay == pytest.approx(0.002)
    assert load_config(write(tmp_path, {})).lanes[0].max_batch_size == 8


@pytest.mark.parametrize(
    ("field", "value"),
    [("maxBatchSize", "8"), ("maxQueueLength", 64.5), ("priority", True), ("name", 3)],
)
def test_wrong_types_are_errors_not_coerced(tmp_path: Path, field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as exc:
        load_config(write(tmp_path, {field: value}))
    assert field in str(exc.value)
