"""The OpenAI-compatible endpoint over the engine (``RolloutEngine.serve()``; docs/serve.md): a conversation
is an episode whose environment is the agent's next request (``AgentEnv``), served token-in/token-out with
vLLM's field names. ``starlette``, ``uvicorn`` and ``openai`` come with the ``serve`` extra."""

from oppo_engine.serve.chat import hermes_tool_parser
from oppo_engine.serve.episode import AgentEnv
from oppo_engine.serve.server import EpisodeHandle, ServeHandle

__all__ = ["AgentEnv", "EpisodeHandle", "ServeHandle", "hermes_tool_parser"]
