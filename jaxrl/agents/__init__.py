"""Multi-turn agent episodes: the environment protocol (env.py), tools (tools.py) and the embedded
environments. `data.task` names an environment through the task registry (jaxrl.data.registry)."""
