"""The server's settings: the engine's fields plus the HTTP ones (flags, STRATA_* variables, config file keys)."""

from __future__ import annotations

from pydantic import Field

from serve.shutdown import DEFAULT_SHUTDOWN_GRACE_S
from strata.config import EngineSettings


class ServeSettings(EngineSettings):
    host: str = Field("0.0.0.0", description="address to listen on")
    port: int = Field(8000, ge=1, le=65535, description="port to listen on")
    api_key: str | None = Field(None, description="require `Authorization: Bearer <key>` on /v1/* (like vLLM)")
    shutdown_grace: float = Field(DEFAULT_SHUTDOWN_GRACE_S, ge=0, allow_inf_nan=False,
                                  description="seconds running answers get to finish after SIGTERM before the server "
                                  "ends them with an error event and exits (keep it below the pod's "
                                  "terminationGracePeriodSeconds)")
    engine_silence: float = Field(60.0, gt=0, allow_inf_nan=False,
                                  description="seconds the engine may say nothing while requests run before /live "
                                  "fails (a hung engine: the orchestrator restarts the container)")
    served_model_name: str | None = Field(None, description="the model name clients send (default: the file or folder name)")
