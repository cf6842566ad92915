"""Agent loops: multi-turn episodes of model turns and environment (tool) turns.

``loop`` runs episodes token-exactly (:class:`AgentLoop`, :func:`run_episode`) against an
:class:`Environment`; ``tools`` parses Hermes/Qwen3 ``<tool_call>``s and holds the built-in
``calculator`` and ``code_interpreter``; ``sandbox`` runs untrusted Python in a limited process.
"""

from megarl.rollout.agent.loop import (
    AgentLoop,
    AgentSettings,
    Environment,
    StepResult,
    ToolEnvironment,
    agent_metrics,
    run_episode,
)
from megarl.rollout.agent.tools import (
    ToolCall,
    calculator,
    code_interpreter,
    parse_tool_calls,
    tool,
)

__all__ = ["AgentLoop", "AgentSettings", "Environment", "StepResult", "ToolCall",
           "ToolEnvironment", "agent_metrics", "calculator", "code_interpreter",
           "parse_tool_calls", "run_episode", "tool"]
