"""Jobs: a job's contract (``spec``), what it runs (``plan``), its phases (``run``: the service's
and ``evalsvc run``'s) and the service that queues and runs it (``service``)."""

from evalsvc.jobs.plan import UnknownConfigs, plan_runs
from evalsvc.jobs.record import describe
from evalsvc.jobs.service import JobService, kill_engine_group
from evalsvc.jobs.spec import (
    BuildSpec,
    JobCreate,
    JobError,
    JobSpec,
    check_storable,
    mint_id,
    validate_job,
)

__all__ = ["BuildSpec", "JobCreate", "JobError", "JobService", "JobSpec", "UnknownConfigs",
           "check_storable", "describe", "kill_engine_group", "mint_id", "plan_runs",
           "validate_job"]
