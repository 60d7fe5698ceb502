"""Server settings: one flat, validated object read from flags, environment and a TOML file.

Precedence, highest first: command-line flags (keyword arguments of :meth:`Settings.load`),
environment variables ``COSYSERVE_<FIELD>`` (e.g. ``COSYSERVE_PORT=9000``), the TOML file
named by ``--config`` or ``COSYSERVE_CONFIG`` (top-level keys named like the fields), then
the defaults below. Invalid values raise :class:`SettingsError` with one line naming the
setting, which the CLI prints as ``error: ...`` (exit status 2).

Keep this one flat class: every field is one setting, documented by its ``description``.
"""

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from cosyserve.accel.precision_choices import Dtype, FlowQuantization, Quantization
from cosyserve.engine.flow_cache_mode import FlowCacheMode, default_flow_cache, flow_prompt_whole_problem
from cosyserve.errors import CosyserveError
from cosyserve.paths import cache_dir, default_model_dir

ENV_PREFIX = "COSYSERVE_"
CONFIG_ENV = "COSYSERVE_CONFIG"

LogLevel = Literal["critical", "error", "warning", "info", "debug"]


class SettingsError(CosyserveError):
    """A setting has an invalid value, or the config file is missing or malformed."""

    code = "invalid_settings"


def _default_voices_db() -> Path:
    return cache_dir() / "voices.sqlite3"


def _default_audio_cache_dir() -> Path:
    return cache_dir() / "audio"


class Settings(BaseSettings):
    """Everything ``cosyserve serve`` can be told. Build with :meth:`load`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", frozen=True, validate_default=True, toml_file=None
    )

    model_dir: Path = Field(
        default_factory=default_model_dir,
        description="CosyVoice2-0.5B model directory (default: $COSYSERVE_MODEL_DIR, else "
        "~/.cache/cosyserve/models/CosyVoice2-0.5B).",
    )
    # Precision (cosyserve.accel.precision, docs/precision.md); checked against the machine at start.
    dtype: Dtype = Field(
        Dtype.FP32, description="LM and flow dtype: fp32, bf16, or fp16 (CUDA only); HiFT stays fp32."
    )
    quantize: Quantization = Field(
        Quantization.NONE,
        description="LM weight quantization: none, int8, int8wo (int8 weights only), or int4 (CUDA only).",
    )
    flow_quantize: FlowQuantization = Field(
        FlowQuantization.NONE,
        description="Flow estimator weights: none, or fp16 (stored in float16, computed in float32; "
        "CPU with dtype fp32 only; faster first chunks on CPUs without bf16, see docs/precision.md).",
    )
    device: str = Field(
        "cpu", min_length=1, description="Device of the model and the KV cache: cpu or cuda[:N]."
    )
    compile: bool = Field(
        False,
        description="torch.compile the LM's MLPs (unquantized LM only; slower start, see docs/precision.md).",
    )
    # Engine options (cosyserve.engine.config.EngineConfig; docs/streaming-flow.md).
    flow_cache: FlowCacheMode | None = Field(
        None,
        description="Streaming flow work per chunk: exact (upstream: recompute prompt + all tokens), "
        "cached (same output, intermediate chunks incremental), incremental (final chunk too); "
        "unset: incremental on a CPU, exact on CUDA (the fastest on each).",
    )
    flow_prompt_cache_mb: int = Field(
        4096,
        ge=0,
        description="MiB of voices' primed flow prompt states kept for streaming first chunks; 0: none.",
    )
    flow_prompt_whole: bool = Field(
        False,
        description="Prime voice prompts through their last block, its look-ahead read as zeros: "
        "shorter streaming first chunks, audio slightly different from upstream's.",
    )
    flow_stream_cache_mb: int = Field(
        0,
        ge=0,
        description="MiB the streams' incremental flow caches may hold together; a stream that "
        "does not fit recomputes each chunk (as flow_cache exact); 0: no bound.",
    )
    flow_cache_compact: bool = Field(
        True,
        description="Streams' incremental flow caches keep the estimator attention layers' inputs and "
        "recompute their keys and values each chunk: about a quarter of the memory, the same output.",
    )
    flow_stream_rows: int = Field(
        2,
        ge=0,
        description="Incremental streaming chunks per flow call; fewer hold less memory at once "
        "(on a CPU, batching more is no faster); 0: no bound.",
    )
    cuda_graphs: bool = Field(
        True,
        description="On a CUDA device, replay LM decode steps from CUDA graphs captured at start, "
        "and each flow call's later Euler steps from a graph of its own; ignored on CPU.",
    )
    traced_decode: bool = Field(
        True,
        description="On a CPU, replay LM decode steps from two TorchScript traces made at start: "
        "about 23 % faster steps, for 2 s of start-up and about 150 MiB (full model); ignored on CUDA "
        "and with compile.",
    )
    traced_flow: bool = Field(
        True,
        description="On a CPU, replay the flow estimator's streaming and non-streaming steps from "
        "TorchScript traces made at start: about 10-25 % faster flow, for about 5 s of start-up and 230 MiB "
        "(full bf16 model); ignored on CUDA and with flow_cache exact.",
    )
    pretouch_mb: int = Field(
        0,
        ge=0,
        description="MiB of memory the engine faults in at start and keeps, so a first burst of "
        "streams does not page-fault its caches in (RSS starts that much higher); 0: none.",
    )
    host: str = Field("127.0.0.1", min_length=1, description="HTTP (and gRPC) listen address.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0: any free port).")
    grpc_port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 disables gRPC.")
    workers: int = Field(
        1, ge=1, le=64, description="Server processes behind the port, each with its own engine."
    )
    max_active: int = Field(8, ge=1, le=1024, description="Requests synthesising at once per process.")
    max_queued: int = Field(
        16, ge=0, le=100_000, description="Requests waiting beyond max_active; more get 429 at once."
    )
    deadline_s: float = Field(
        300.0, ge=0, description="A request's whole-life limit in seconds (504 past it); 0: none."
    )
    max_text_chars: int = Field(
        2000, ge=1, le=1_000_000, description="Longest input text of POST /v1/audio/speech."
    )
    max_tts_text_chars: int = Field(200, ge=1, le=1_000_000, description="Longest text of GET /tts.")
    max_upload_bytes: int = Field(
        10 * 1024 * 1024, ge=1024, description="Largest request body (prompt audio uploads); 413 past it."
    )
    # Access control (cosyserve.server.auth): on unless auth_mode = "none" is set explicitly.
    auth_mode: Literal["on", "none"] = Field(
        "on", description='"on": every route but /health and /ready needs a credential; "none": open.'
    )
    auth_api_keys: str = Field(
        "", description="API keys as comma-separated name:hash entries (`cosyserve auth hash-key`)."
    )
    auth_api_keys_file: str = Field("", description="File of name:hash API key entries, one a line.")
    auth_basic_users: str = Field("", description="HTTP Basic users as comma-separated user:hash entries.")
    auth_basic_users_file: str = Field("", description="File of user:hash Basic entries, one a line.")
    auth_jwks: str = Field("", description="JWKS of the OIDC/JWT issuer: an https:// URL or a file path.")
    auth_jwt_issuer: str = Field("", description="Required JWT issuer (iss).")
    auth_jwt_audience: str = Field("", description="Required JWT audience (aud).")
    auth_jwt_algorithms: str = Field("RS256,ES256", description="Accepted JWT algorithms, comma-separated.")
    auth_jwks_refresh_s: float = Field(300.0, gt=0, description="Seconds the fetched key set is used.")
    auth_gateway_header: str = Field("", description="Identity header set by a trusted gateway.")
    auth_gateway_trusted: str = Field(
        "", description="Gateway addresses/CIDR networks, comma-separated; the header counts only from them."
    )
    auth_metrics: bool = Field(True, description="Whether /metrics needs a credential too.")
    auth_voice_admins: str = Field(
        "", description="Identities that may add/delete voices, comma-separated; empty: all authenticated."
    )
    rate_limit_rpm: float = Field(0.0, ge=0, description="Requests per minute per identity; 0: no limit.")
    rate_limit_audio_s: float = Field(
        0.0, ge=0, description="Seconds of synthesized audio per minute per identity; 0: no limit."
    )
    auth_failures_per_min: float = Field(
        60.0,
        ge=0,
        description="Failed authentications per minute per client address before 429; 0: no limit.",
    )
    # Input guard (cosyserve.server.guard).
    sensitive_words_file: str = Field(
        "", description="Sensitive words or phrases, one a line; reloaded on SIGHUP. Empty: none."
    )
    sensitive_words_action: Literal["reject", "mask"] = Field(
        "reject", description='"reject": the request fails (400 blocked_content); "mask": words become "*".'
    )
    max_prompt_audio_s: float = Field(
        30.0, gt=0, le=30.0, description="Longest prompt or voice recording, seconds (upstream's limit: 30)."
    )
    voices_db: Path = Field(
        default_factory=_default_voices_db,
        description="SQLite file of registered voices (default ~/.cache/cosyserve/voices.sqlite3).",
    )
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="On SIGTERM, how long in-flight requests may finish before abort."
    )
    frontend_threads: int = Field(
        2, ge=1, le=64, description="Threads for CPU request preparation (text, prompt features)."
    )
    log_level: LogLevel = Field("info", description="Log level of the server process(es).")
    log_format: Literal["json", "text"] = Field(
        "json", description='Server log lines: "json" (one object a line) or "text" (human-readable).'
    )
    log_text_chars: int = Field(
        0, ge=0, le=10_000, description="Characters of a request's text in its summary log line; 0: none."
    )
    memory_watch_interval_s: float = Field(
        30.0, ge=0, description="Seconds between idle memory samples (RSS, CUDA); 0: no watchdog."
    )
    memory_watch_window: int = Field(10, ge=2, le=10_000, description="Samples a memory trend is judged on.")
    memory_growth_warn_mb: int = Field(
        512, ge=1, description="Sustained growth over the window, in MiB, that is logged as a warning."
    )
    cuda_alloc_conf: str = Field(
        "expandable_segments:True",
        description="PYTORCH_CUDA_ALLOC_CONF for the process unless that variable is set; empty: leave it.",
    )
    cuda_empty_cache_when_idle: bool = Field(
        False, description="Return the CUDA allocator's unused blocks to the device at each idle sample."
    )
    verify_model: bool = Field(
        True,
        description="At start, check every model file's sha256 against manifest.sha256 (a few "
        "seconds for the full model); false only checks that the listed files are there.",
    )
    audio_cache_mb: int = Field(
        0, ge=0, description="Size cap of the cache of non-streaming results with a seed, in MiB; 0: off."
    )
    audio_cache_dir: Path = Field(
        default_factory=_default_audio_cache_dir,
        description="Audio cache directory, wiped at start; a tmpfs is best (e.g. /dev/shm/cosyserve-audio).",
    )
    audio_cache_ttl_s: float = Field(3600.0, gt=0, description="Seconds an audio cache entry is served.")

    @model_validator(mode="after")
    def _whole_prompt_needs_the_prompt_cache(self) -> "Settings":
        problem = flow_prompt_whole_problem(
            self.flow_prompt_whole,
            self.flow_cache or default_flow_cache(self.device),
            self.flow_prompt_cache_mb,
        )
        if problem:
            raise ValueError(problem)
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))

    @classmethod
    def load(cls, config_file: Path | None = None, **overrides: Any) -> "Settings":
        """Settings from ``overrides`` (flags; None values are ignored), the environment,
        and ``config_file`` (else ``$COSYSERVE_CONFIG``, else none)."""
        path = config_file or (Path(os.environ[CONFIG_ENV]) if os.environ.get(CONFIG_ENV) else None)
        if path is not None and not path.is_file():
            raise SettingsError(f"config file {path} does not exist")
        # The TOML source reads the file named in model_config, so bind it to a subclass.
        bound = type(
            cls.__name__,
            (cls,),
            {"model_config": {**cls.model_config, "toml_file": path}, "__module__": cls.__module__},
        )
        given = {k: v for k, v in overrides.items() if v is not None}
        try:
            return bound(**given)  # type: ignore[no-any-return]
        except ValidationError as exc:
            raise SettingsError(_describe(exc, path)) from None
        except (OSError, ValueError) as exc:  # unreadable or malformed TOML
            raise SettingsError(f"cannot read config file {path}: {exc}") from None

    def to_env(self) -> dict[str, str]:
        """These settings as ``COSYSERVE_*`` variables: how worker processes receive them.
        An unset setting (None) has no variable, so it is unset there too."""
        return {
            f"{ENV_PREFIX}{name.upper()}": str(value)
            for name, value in self.model_dump().items()
            if value is not None
        }


def _describe(exc: ValidationError, path: Path | None) -> str:
    first = exc.errors()[0]
    name = ".".join(str(part) for part in first["loc"]) or "settings"
    if first["type"] == "extra_forbidden":
        where = f" in {path}" if path is not None else ""
        return f"unknown setting {name!r}{where}"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    if not first["loc"]:  # a check across settings (a model validator)
        return f"invalid settings: {first['msg'].removeprefix('Value error, ')}{more}"
    return f"invalid setting {name}: {first['msg']}{more}"


def settings_reference() -> list[tuple[str, str, str, str]]:
    """(name, environment variable, default, description) of every setting, in order;
    ``serve --help`` and the README show them."""
    rows = []
    for name, info in Settings.model_fields.items():
        default = info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]
        shown = "(none)" if default is None or default == "" else str(default)
        rows.append((name, f"COSYSERVE_{name.upper()}", shown, (info.description or "").strip()))
    return rows
