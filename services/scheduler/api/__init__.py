"""The public API as data, free of HTTP and of protobuf: request bodies as schema nodes,
their validation into request dataclasses, the OpenAPI document, OpenAI's output shapes
and OpenAI-shaped errors."""
