"""What ``serve run cosyserve.deploy.ray:build_app KEY=VALUE ...`` accepts, validated.

Ray hands an application builder its ``KEY=VALUE`` arguments as a dict of strings. The
keys below shape the deployment (replicas, autoscaling, resources, health checks); every
other key is a server setting, as ``cosyserve serve`` takes it (``model_dir``,
``voices_db``, ``profile``, ``auth_mode``, ``max_active``, ...; docs/configuration.md),
with the same ``COSYSERVE_*`` environment variables and config file behind it. Ray owns
the HTTP listener, so ``host``, ``port``, ``grpc_port`` and ``workers`` are refused.

This module does not import Ray: the arguments can be checked, and tested, without it.
"""

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cosyserve.errors import CosyserveError
from cosyserve.server.settings import Settings, SettingsError

# Settings that belong to Ray on this path: its proxy listens, and each replica is one process.
_RAY_OWNED = {
    "host": "Ray Serve's proxy listens instead (serve start --http-host)",
    "port": "Ray Serve's proxy listens instead (serve start --http-port)",
    "grpc_port": "gRPC is not served through Ray Serve",
    "workers": "each replica is one process; scale with num_replicas or max_replicas",
}


class RayArgsError(CosyserveError, ValueError):
    """An argument of the Ray Serve application is unknown or has an invalid value."""

    code = "invalid_ray_args"


class DeploymentArgs(BaseModel):
    """The arguments that shape the Ray Serve deployment; each has a default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_replicas: int | None = Field(
        None, ge=1, description="A fixed number of replicas; unset: autoscaling between the two below."
    )
    min_replicas: int = Field(1, ge=1, description="Fewest replicas the autoscaler keeps.")
    max_replicas: int = Field(1, ge=1, description="Most replicas the autoscaler starts.")
    target_ongoing_requests: float = Field(
        2.0, gt=0, description="Requests in flight per replica the autoscaler aims at."
    )
    upscale_delay_s: float = Field(30.0, ge=0, description="Load above target this long adds replicas.")
    downscale_delay_s: float = Field(600.0, ge=0, description="Load below target this long removes replicas.")
    look_back_period_s: float = Field(30.0, gt=0, description="Window the autoscaler averages load over.")
    max_ongoing_requests: int | None = Field(
        None,
        ge=1,
        description="Requests Ray routes to one replica at once (more wait in Ray's queue); "
        "unset: the replica's capacity, max_active + max_queued.",
    )
    max_replicas_per_node: int | None = Field(
        None, ge=1, description="Most replicas on one Ray node; unset: no limit."
    )
    num_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves for each replica.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves for each replica (1: one GPU each).")
    threads: int | None = Field(
        None, ge=1, description="torch threads of each replica's engine; unset: num_cpus (at least 1)."
    )
    health_check_period_s: float = Field(10.0, gt=0, description="Seconds between replica health checks.")
    health_check_timeout_s: float = Field(30.0, gt=0, description="A health check slower than this fails.")

    @model_validator(mode="after")
    def _replicas_ordered(self) -> "DeploymentArgs":
        autoscaling = {"min_replicas", "max_replicas", "target_ongoing_requests"} & self.model_fields_set
        if self.num_replicas is not None and autoscaling:
            raise ValueError(
                f"num_replicas fixes the count: {', '.join(sorted(autoscaling))} would be ignored"
            )
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) is below min_replicas ({self.min_replicas})"
            )
        return self


@dataclass(frozen=True)
class RayAppPlan:
    """Everything the deployment needs: the replicas' server settings, their torch
    threads and the keyword arguments of Ray's ``Deployment.options``."""

    settings: Settings
    threads: int
    options: dict[str, Any]

    @property
    def settings_values(self) -> dict[str, Any]:
        """The settings as plain values, complete, for the replicas to rebuild them from
        (so that a replica's own environment cannot change them)."""
        return self.settings.model_dump(mode="json")


def plan_ray_app(args: dict[str, Any]) -> RayAppPlan:
    """Validate ``args`` (Ray's ``KEY=VALUE`` pairs); raises :class:`RayArgsError` naming
    the first offending key."""
    deployment_keys = DeploymentArgs.model_fields.keys()
    deployment = {key: value for key, value in args.items() if key in deployment_keys}
    server = {key: value for key, value in args.items() if key not in deployment_keys}
    for key, why in _RAY_OWNED.items():
        if key in server:
            raise RayArgsError(f"{key} cannot be set on Ray Serve: {why}")
    try:
        shape = DeploymentArgs(**deployment)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = ".".join(str(part) for part in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise RayArgsError(f"invalid argument {name}: {message}" if name else message) from None
    try:
        settings = Settings.load(**server, grpc_port=0, workers=1)
    except SettingsError as exc:
        message = str(exc)
        if message.startswith("unknown setting"):
            name = message.removeprefix("unknown setting ")
            message = f"unknown argument {name}: neither a deployment argument nor a server setting"
        raise RayArgsError(message) from None
    threads = shape.threads or max(1, int(shape.num_cpus))
    return RayAppPlan(settings, threads, _options(shape, settings))


def _options(shape: DeploymentArgs, settings: Settings) -> dict[str, Any]:
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": shape.num_cpus, "num_gpus": shape.num_gpus},
        "max_ongoing_requests": shape.max_ongoing_requests or settings.max_active + settings.max_queued,
        "health_check_period_s": shape.health_check_period_s,
        "health_check_timeout_s": shape.health_check_timeout_s,
        # Ray waits this long for a stopping replica's requests, like SIGTERM's grace.
        "graceful_shutdown_timeout_s": settings.shutdown_grace_s,
    }
    if shape.max_replicas_per_node is not None:
        options["max_replicas_per_node"] = shape.max_replicas_per_node
    if shape.num_replicas is not None:
        options["num_replicas"] = shape.num_replicas
    else:
        options["autoscaling_config"] = {
            "min_replicas": shape.min_replicas,
            "max_replicas": shape.max_replicas,
            "target_ongoing_requests": shape.target_ongoing_requests,
            "upscale_delay_s": shape.upscale_delay_s,
            "downscale_delay_s": shape.downscale_delay_s,
            "look_back_period_s": shape.look_back_period_s,
        }
    return options
