"""The HTTP layer of ``mega serve``: one app factory, errors, guards (API key, body limit,
admission) and the routers, which import the common modules and never each other."""
