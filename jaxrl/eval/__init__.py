"""`jaxrl eval`: greedy accuracy, pass@k and maj@k of a policy on its task's test split."""
