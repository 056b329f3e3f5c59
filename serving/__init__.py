"""Serving end to end: ``vllm serve`` with and without speculation, compared
over the OpenAI-compatible API (issue 7). See ``serving/README.md``."""
