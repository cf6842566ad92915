"""SGLang servers: launch command lines, processes, and the async HTTP client."""

from megarl.rollout.sglang.client import EngineError, SGLangClient
from megarl.rollout.sglang.launcher import (
    SGLangLaunchConfig,
    SGLangNotInstalled,
    build_router_command,
    build_sglang_command,
    launch_router,
    launch_sglang_engines,
)

__all__ = ["EngineError", "SGLangClient", "SGLangLaunchConfig", "SGLangNotInstalled",
           "build_router_command", "build_sglang_command", "launch_router",
           "launch_sglang_engines"]
