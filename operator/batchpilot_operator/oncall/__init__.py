"""On-call views of a BatchingPolicy (pure: a policy object in, summaries and rich renderables out)."""
