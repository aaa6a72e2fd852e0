"""The public HTTP API (aiohttp): the app and its typed state, the OpenAI routes (chat,
completions, Responses, models), advisories, admin, health and metrics, the static pages,
and the hardened server that runs it."""
