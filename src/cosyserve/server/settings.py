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
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_serializer, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from cosyserve.accel.flow_cache_mode import DEFAULT_FLOW_PROMPT_CACHE_MB
from cosyserve.accel.precision_choices import Choices, Dtype, FlowQuantization, Profile, Quantization
from cosyserve.engine.admission import DEFAULT_MAX_ACTIVE, DEFAULT_MAX_WAITING
from cosyserve.errors import CosyserveError
from cosyserve.paths import cache_dir, default_model_dir

ENV_PREFIX = "COSYSERVE_"
CONFIG_ENV = "COSYSERVE_CONFIG"

LogLevel = Literal["critical", "error", "warning", "info", "debug"]


class SettingsError(CosyserveError):
    """A setting has an invalid value, or the config file is missing or malformed."""

    code = "invalid_settings"


def _default_voices_db() -> str:
    return str(cache_dir() / "voices.sqlite3")


class Settings(BaseSettings):
    """Everything ``cosyserve serve`` can be told. Build with :meth:`load`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", frozen=True, validate_default=True, toml_file=None
    )

    # -- model: what runs, and how fast -----------------------------------------------------
    # A tuple: several directories (of either family) are served at once, the first by default
    # (docs/models.md). A flag repeats, the variable and a TOML string separate them with
    # os.pathsep, a TOML list lists them; model_dump() writes them as the variable does.
    model_dir: Annotated[tuple[Path, ...], NoDecode] = Field(
        default_factory=lambda: (default_model_dir(),),
        description="Model directory (CosyVoice2-0.5B or Fun-CosyVoice3-0.5B-2512), or several, served "
        "at once and picked by the request's model (the first by default); separated by "
        f"{os.pathsep!r} in the variable, a list in the file (default: $COSYSERVE_MODEL_DIR, else "
        "~/.cache/cosyserve/models/CosyVoice2-0.5B).",
    )
    profile: Profile = Field(
        Profile.AUTO,
        description="auto: the fastest plan measured for this machine, else the safe one; fast: the "
        "fastest plan; exact: float32, upstream's output (docs/performance.md).",
    )
    # Each overrides one choice of the profile's plan (cosyserve.accel.plan; docs/precision.md).
    device: str | None = Field(
        None, min_length=1, description="Device: cpu or cuda[:N]; unset: the profile's (a GPU if any)."
    )
    dtype: Dtype | None = Field(
        None, description="LM and flow dtype: fp32, bf16, or fp16 (CUDA only); unset: the profile's."
    )
    quantize: Quantization | None = Field(
        None,
        description="LM weights: none, int8, int8wo (int8 weights only), or int4 (CUDA only); "
        "unset: the profile's.",
    )
    flow_quantize: FlowQuantization | None = Field(
        None,
        description="Flow estimator weights: none, or fp16 (stored in float16, computed in float32; "
        "CPU with dtype fp32 only); unset: the profile's.",
    )
    verify_model: bool = Field(
        True,
        description="At start, check every model file's sha256 against manifest.sha256 (a few "
        "seconds for the full model); false only checks that the listed files are there.",
    )
    default_voice: str = Field(
        "",
        description="Voice of requests that name none (GET /tts): a built-in speaker, an alias "
        "(zh_female, zh_male, en_female, en_male) or a registered voice; empty: the first built-in.",
    )
    pronunciations: str = Field(
        "",
        description="Pronunciation dictionary: a file of words and how to say them, one a line "
        "(docs/cosyvoice3.md); reloaded on SIGHUP. Empty: none.",
    )
    voices_db: str = Field(
        default_factory=_default_voices_db,
        min_length=1,
        description="Registered voices: an SQLite file (default ~/.cache/cosyserve/voices.sqlite3), or a "
        "postgresql:// URL shared by every replica (extra `postgres`), or @FILE holding either.",
    )
    # -- server -----------------------------------------------------------------------------
    host: str = Field("127.0.0.1", min_length=1, description="HTTP (and gRPC) listen address.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0: any free port).")
    grpc_port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 disables gRPC.")
    workers: int = Field(
        1, ge=1, le=64, description="Server processes behind the port, each with its own engine."
    )
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="On SIGTERM, how long in-flight requests may finish before abort."
    )
    # -- limits -----------------------------------------------------------------------------
    max_active: int = Field(
        DEFAULT_MAX_ACTIVE, ge=1, le=1024, description="Requests synthesising at once per process."
    )
    max_queued: int = Field(
        DEFAULT_MAX_WAITING,
        ge=0,
        le=100_000,
        description="Requests waiting beyond max_active; more get 429 at once.",
    )
    deadline_s: float = Field(
        300.0, ge=0, description="A request's whole-life limit in seconds (504 past it); 0: none."
    )
    max_text_chars: int = Field(
        2000, ge=1, le=1_000_000, description="Longest input text of a request (every route)."
    )
    max_upload_bytes: int = Field(
        10 * 1024 * 1024, ge=1024, description="Largest request body (prompt audio uploads); 413 past it."
    )
    max_prompt_audio_s: float = Field(
        30.0, gt=0, le=30.0, description="Longest prompt or voice recording, seconds (upstream's limit: 30)."
    )
    rate_limit_rpm: float = Field(0.0, ge=0, description="Requests per minute per identity; 0: no limit.")
    rate_limit_audio_s: float = Field(
        0.0, ge=0, description="Seconds of synthesized audio per minute per identity; 0: no limit."
    )
    flow_prompt_cache_mb: int = Field(
        DEFAULT_FLOW_PROMPT_CACHE_MB,
        ge=0,
        description="MiB of voices' primed flow prompt states kept for streaming first chunks; 0: none.",
    )
    audio_cache_mb: int = Field(
        0,
        ge=0,
        description="MiB of finished non-streaming results with a seed kept on disk (under the cache "
        "directory) and served again; 0: off.",
    )
    # -- auth (cosyserve.server.auth): on unless auth_mode = "none" is set explicitly ----------
    auth_mode: Literal["on", "none"] = Field(
        "on", description='"on": every route but /health and /ready needs a credential; "none": open.'
    )
    auth_api_keys: str = Field(
        "",
        description="API keys as comma-separated name:hash entries (`cosyserve auth hash-key`), "
        "or @FILE: a file of entries, one a line.",
    )
    auth_basic_users: str = Field(
        "", description="HTTP Basic users as comma-separated user:hash entries, or @FILE (one a line)."
    )
    auth_jwks: str = Field("", description="JWKS of the OIDC/JWT issuer: an https:// URL or a file path.")
    auth_jwt_issuer: str = Field("", description="Required JWT issuer (iss).")
    auth_jwt_audience: str = Field("", description="Required JWT audience (aud).")
    auth_gateway_header: str = Field("", description="Identity header set by a trusted gateway.")
    auth_gateway_trusted: str = Field(
        "", description="Gateway addresses/CIDR networks, comma-separated; the header counts only from them."
    )
    auth_metrics: bool = Field(True, description="Whether /metrics needs a credential too.")
    auth_voice_admins: str = Field(
        "", description="Identities that may add/delete voices, comma-separated; empty: all authenticated."
    )
    auth_failures_per_min: float = Field(
        60.0,
        ge=0,
        description="Failed authentications per minute per client address before 429; 0: no limit.",
    )
    # -- logging and input guard --------------------------------------------------------------
    log_level: LogLevel = Field("info", description="Log level of the server process(es).")
    log_text_chars: int = Field(
        0, ge=0, le=10_000, description="Characters of a request's text in its summary log line; 0: none."
    )
    sensitive_words_file: str = Field(
        "", description="Sensitive words or phrases, one a line; reloaded on SIGHUP. Empty: none."
    )
    sensitive_words_action: Literal["reject", "mask"] = Field(
        "reject", description='"reject": the request fails (400 blocked_content); "mask": words become "*".'
    )

    @field_validator("model_dir", mode="before")
    @classmethod
    def _model_dirs(cls, value: object) -> object:
        # One directory (a Path, or text without a separator) is the usual case.
        if isinstance(value, os.PathLike):
            return (value,)
        if isinstance(value, str):
            return tuple(part for part in value.split(os.pathsep) if part)
        return value

    @field_validator("model_dir")
    @classmethod
    def _distinct_model_dirs(cls, value: tuple[Path, ...]) -> tuple[Path, ...]:
        if not value:
            raise ValueError("at least one model directory is needed")
        seen: dict[str, Path] = {}
        resolved: set[Path] = set()
        for path in value:
            where = path.expanduser().resolve()
            if where in resolved:
                raise ValueError(f"model directory {path} is given twice")
            resolved.add(where)
            # The directory's name is the model's id in requests (its `model`).
            if path.name in seen:
                raise ValueError(
                    f"model directories {seen[path.name]} and {path} have the same name {path.name!r}, "
                    "which is the model's id: rename one (or link it under another name)"
                )
            seen[path.name] = path
        return value

    @field_serializer("model_dir")
    def _model_dirs_as_text(self, value: tuple[Path, ...]) -> str:
        return os.pathsep.join(str(path) for path in value)

    @property
    def first_model_dir(self) -> Path:
        """The default model's directory: the first of ``model_dir``."""
        return self.model_dir[0]

    @field_validator("voices_db", mode="before")
    @classmethod
    def _path_as_text(cls, value: object) -> object:
        # A Path (a flag, a caller) names the same SQLite file as its text.
        return os.fspath(value) if isinstance(value, os.PathLike) else value

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

    def choices(self) -> Choices:
        """The explicit precision choices, which override the profile's plan one each."""
        return Choices(self.dtype, self.quantize, self.flow_quantize, self.device)

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


# The settings by what they decide, in ``serve --help`` and docs/configuration.md.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
    (group, tuple(names.split()))
    for group, names in (
        (
            "model",
            "model_dir profile device dtype quantize flow_quantize verify_model default_voice pronunciations "
            "voices_db",
        ),
        ("server", "host port grpc_port workers shutdown_grace_s"),
        (
            "limits",
            "max_active max_queued deadline_s max_text_chars max_upload_bytes "
            "max_prompt_audio_s rate_limit_rpm rate_limit_audio_s flow_prompt_cache_mb audio_cache_mb",
        ),
        (
            "auth",
            "auth_mode auth_api_keys auth_basic_users auth_jwks auth_jwt_issuer auth_jwt_audience "
            "auth_gateway_header auth_gateway_trusted auth_metrics auth_voice_admins auth_failures_per_min",
        ),
        ("logging", "log_level log_text_chars sensitive_words_file sensitive_words_action"),
    )
)


def settings_reference() -> list[tuple[str, list[tuple[str, str, str, str]]]]:
    """Per group, (name, environment variable, default, description) of each setting;
    ``serve --help`` and docs/configuration.md show them."""
    fields = Settings.model_fields
    grouped = []
    for group, names in GROUPS:
        rows = []
        for name in names:
            info = fields[name]
            default = info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]
            if isinstance(default, tuple):  # model_dir: as its variable writes it
                default = os.pathsep.join(str(part) for part in default)
            shown = "(none)" if default is None or default == "" else str(default)
            rows.append((name, f"COSYSERVE_{name.upper()}", shown, (info.description or "").strip()))
        grouped.append((group, rows))
    return grouped
