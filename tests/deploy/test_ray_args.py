"""The Ray Serve application's arguments: what ``serve run ... KEY=VALUE`` becomes, and the
clear error each bad one gets (no Ray needed)."""

from pathlib import Path

import pytest

from cosyserve.deploy.ray_args import RayArgsError, plan_ray_app


def test_strings_become_a_fixed_deployment_and_complete_settings(tmp_path: Path) -> None:
    # Ray passes every value as a string, as typed after `serve run`.
    plan = plan_ray_app(
        {
            "model_dir": str(tmp_path),
            "num_replicas": "3",
            "num_cpus": "2",
            "max_active": "4",
            "max_queued": "6",
            "voices_db": "postgresql://u:p@db:5432/voices",
        }
    )
    assert plan.threads == 2  # one torch thread per reserved CPU
    assert plan.options == {
        "num_replicas": 3,
        "ray_actor_options": {"num_cpus": 2.0, "num_gpus": 0.0},
        "max_ongoing_requests": 10,  # the replica's own capacity: max_active + max_queued
        "health_check_period_s": 10.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": 30.0,
    }
    values = plan.settings_values
    assert values["model_dir"] == str(tmp_path) and values["voices_db"] == "postgresql://u:p@db:5432/voices"
    assert values["grpc_port"] == 0 and values["workers"] == 1
    # Every setting is there, so a replica's own environment cannot change one.
    assert "auth_mode" in values and "deadline_s" in values


def test_autoscaling_by_default(tmp_path: Path) -> None:
    plan = plan_ray_app(
        {
            "model_dir": str(tmp_path),
            "min_replicas": "1",
            "max_replicas": "4",
            "target_ongoing_requests": "3",
            "upscale_delay_s": "5",
            "num_gpus": "1",
            "threads": "3",
            "max_replicas_per_node": "1",
            "max_ongoing_requests": "12",
        }
    )
    assert plan.threads == 3
    assert plan.options["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 3.0,
        "upscale_delay_s": 5.0,
        "downscale_delay_s": 600.0,
        "look_back_period_s": 30.0,
    }
    assert "num_replicas" not in plan.options
    assert plan.options["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert plan.options["max_replicas_per_node"] == 1 and plan.options["max_ongoing_requests"] == 12


def test_a_fraction_of_a_cpu_still_gets_one_thread(tmp_path: Path) -> None:
    assert plan_ray_app({"model_dir": str(tmp_path), "num_cpus": "0.5"}).threads == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"port": "8000"}, "port cannot be set on Ray Serve: Ray Serve's proxy listens instead"),
        ({"grpc_port": "50051"}, "grpc_port cannot be set on Ray Serve: gRPC is not served"),
        ({"workers": "2"}, "workers cannot be set on Ray Serve"),
        ({"num_replicas": "0"}, "invalid argument num_replicas: Input should be greater than or equal to 1"),
        ({"num_cpus": "many"}, "invalid argument num_cpus: Input should be a valid number"),
        ({"min_replicas": "3", "max_replicas": "2"}, "max_replicas (2) is below min_replicas (3)"),
        (
            {"num_replicas": "2", "max_replicas": "4"},
            "num_replicas fixes the count: max_replicas would be ignored",
        ),
        ({"replicas": "2"}, "unknown argument 'replicas': neither a deployment argument nor a server"),
        ({"max_active": "lots"}, "invalid setting max_active: Input should be a valid integer"),
        ({"profile": "fastest"}, "invalid setting profile"),
    ],
)
def test_bad_arguments_are_named(args: dict[str, str], message: str) -> None:
    with pytest.raises(RayArgsError) as raised:
        plan_ray_app(args)
    assert str(raised.value).startswith(message), str(raised.value)
    assert isinstance(raised.value, ValueError)  # what Ray reports for a builder's bad arguments
