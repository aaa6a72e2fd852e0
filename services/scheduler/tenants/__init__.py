"""Who may call and how much: API keys and admin keys as digests, and each tenant's
request and advisory rates and generations in flight."""
