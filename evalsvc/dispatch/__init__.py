"""Where runs execute: the engine slots of this machine, or a Ray cluster (the only place that
knows whether Ray exists)."""

from __future__ import annotations

from evalsvc.dispatch.errors import DispatchError
from evalsvc.settings import Settings

__all__ = ["DispatchError", "make_dispatcher"]


def make_dispatcher(settings: Settings):
    """The Ray dispatcher when EVALSVC_RAY_ADDRESS is set, else the local engine slots."""
    if settings.ray_address:
        from evalsvc.dispatch.ray_backend import RayDispatcher

        return RayDispatcher(settings.ray_address, settings.ray_slot_resource,
                             retries=settings.ray_retries)
    from evalsvc.dispatch.local import LocalDispatcher

    return LocalDispatcher(settings.engine_slots, settings.resolved_builds_dir())
