"""Probes: ``/health`` (the process is alive) and ``/ready`` (it can synthesise now)."""

from fastapi import APIRouter, Request, Response

from cosyserve.server.http.deps import runtime_of
from cosyserve.server.http.wire import Health, Readiness
from cosyserve.server.runtime import Phase

router = APIRouter(tags=["health"])


@router.get("/health")
async def health(request: Request) -> Health:
    """200 while the process runs, even before the model is loaded (liveness); with the
    speed plan once it is chosen."""
    runtime = runtime_of(request)
    plan = runtime.plan
    plans = {model_id: service.model.plan.labels() for model_id, service in runtime.models.items()}
    return Health(plan=None if plan is None else plan.labels(), plans=plans)


@router.get("/ready", responses={503: {"model": Readiness}})
async def ready(request: Request, response: Response) -> Readiness:
    """200 once every model is loaded and warmed up and their engine threads run; else 503.
    The body also tells how busy the process is."""
    runtime = runtime_of(request)
    settings = runtime.settings
    status = runtime.phase.value
    if runtime.phase is Phase.READY and not runtime.engine_alive:
        status = "engine_dead"
    response.status_code = 200 if runtime.ready else 503
    return Readiness(
        status=status,
        model=runtime.model_ids[0],
        engine_alive=runtime.engine_alive,
        in_flight=sum(service.in_flight for service in runtime.services),
        engine_requests=runtime.engine_requests,
        capacity=settings.max_active + settings.max_queued,
        models=runtime.model_states(),
    )
