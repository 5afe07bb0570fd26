"""Jobs: where the store and the dispatcher meet (``service``)."""

from evalsvc.jobs.service import (
    ACTIVE,
    BuildSpec,
    JobCreate,
    JobError,
    JobService,
    check_storable,
    describe,
    kill_engine_group,
)

__all__ = ["ACTIVE", "BuildSpec", "JobCreate", "JobError", "JobService", "check_storable",
           "describe", "kill_engine_group"]
