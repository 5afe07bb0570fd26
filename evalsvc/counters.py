"""What the job runner counts for the service's ``/metrics``: finished jobs by status, and each
run's wall time in a ``prometheus_client`` histogram, observed as the run ends."""

from __future__ import annotations

from prometheus_client import Histogram

DURATION_BUCKETS = (5, 15, 30, 60, 120, 300, 600, 1800, 3600, float("inf"))


class Counters:
    def __init__(self) -> None:
        self.outcomes: dict[str, int] = {}
        self.run_duration = Histogram("evalsvc_run_duration_seconds", "Run wall time.",
                                      buckets=DURATION_BUCKETS, registry=None)

    def run_finished(self, seconds: float) -> None:
        self.run_duration.observe(seconds)

    def collect_run_duration(self):
        """The histogram's metric family, its buckets, count and sum (not its creation time)."""
        for family in self.run_duration.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family
