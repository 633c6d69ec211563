"""The agent gateway: an OpenAI-compatible server the run owns, in front of its rollout engines, that records
token-exact trajectories of the user's own agent (docs/agents.md, "Train an agent as it is").

- `server`: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` per episode, on loopback, keyed;
- `recording`: the calls of an episode, and the history prefix match that keeps sampled ids as sampled;
- `samples`: recorded calls as training samples (one trajectory with loss masks, or one sample per call);
- `generate`: ``rollout.generate_fn: gateway``, which runs the agent per sample.
"""

from slime_rl.core.gateway.generate import GatewayGenerate, agent_reward
from slime_rl.core.gateway.messages import GatewayError
from slime_rl.core.gateway.recording import Episode, RecordedCall
from slime_rl.core.gateway.samples import SAMPLE_MODES, episode_samples
from slime_rl.core.gateway.server import Gateway, GatewaySettings

__all__ = ["SAMPLE_MODES", "Episode", "Gateway", "GatewayError", "GatewayGenerate", "GatewaySettings",
           "RecordedCall", "agent_reward", "episode_samples"]
