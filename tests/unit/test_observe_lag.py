"""The command agent's lag gauge must not crash the agent for a partition just revoked."""

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from faust.types import TP

from base.settings import Settings
from streams import metrics
from streams.app import Worker


def _event(tp: TP, offset: int) -> Any:
    return SimpleNamespace(message=SimpleNamespace(tp=tp, offset=offset))


def test_a_batch_spanning_a_revocation_sets_lag_only_for_partitions_still_held(
    tmp_path: Path,
) -> None:
    worker = Worker(Settings.from_env({"TOCSIN_STATE_DIR": str(tmp_path)}))
    app: Any = worker.app
    kept = TP(worker.catalog.commands.name, 0)
    given_away = TP(worker.catalog.commands.name, 1)

    def highwater(tp: TP) -> int:
        # aiokafka asserts the partition is assigned, as it does when a batch read before
        # a rebalance is finished after it.
        assert tp == kept, "Partition is not assigned"
        return 10

    app.consumer.assignment = lambda: {kept}
    app.consumer.highwater = highwater

    worker._observe_lag(app, [_event(kept, 3), _event(given_away, 7)])

    assert metrics.CONSUMER_LAG.labels("0")._value.get() == 6
