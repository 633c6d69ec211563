"""Served roles beside the policy (config/roles.py): the client every caller uses (`RoleClient`), where the
run's roles answer (`role_client`, for reward functions), the teacher's log-probs for on-policy distillation
and the reward model's batched scores. docs/roles.md."""

from slime_rl.core.roles.client import RoleClient, RoleError
from slime_rl.core.roles.endpoints import ENV_ROLES_FILE, Endpoint, read_endpoints, role_client

__all__ = ["ENV_ROLES_FILE", "Endpoint", "RoleClient", "RoleError", "read_endpoints", "role_client"]
